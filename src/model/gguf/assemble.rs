//! A decoder assembled from a GGUF file's tensors: the config read, every block's matrices
//! located and packed at once (q, k, v and gate, up end to end), norms, experts, DeltaNet
//! layers and per-layer embeddings built for the architecture's pieces. The file reading itself
//! is `gguf.rs`.

use super::*;

/// The projections of layer `i`, each its tensor name (less `.weight`) and `[rows, cols]`: q, k,
/// v, output, gate, up, down (the order [`GgufFile::pack_all`] keeps, so that q, k, v and gate,
/// up lie end to end).
fn layer_matrices(cfg: &Config, i: usize) -> [(String, [usize; 2]); 7] {
    let (h, nh, ffn) = (cfg.hidden, cfg.n_head, cfg.layer_ffn(i));
    let (nkv, hd) = cfg.layer_kv_shape(i);
    let p = format!("blk.{i}");
    let q_rows = if cfg.pieces.q_gate {
        2 * nh * hd
    } else {
        nh * hd
    };
    [
        (format!("{p}.attn_q"), [q_rows, h]),
        (format!("{p}.attn_k"), [nkv * hd, h]),
        (format!("{p}.attn_v"), [nkv * hd, h]),
        (format!("{p}.attn_output"), [h, nh * hd]),
        (format!("{p}.ffn_gate"), [ffn, h]),
        (format!("{p}.ffn_up"), [ffn, h]),
        (format!("{p}.ffn_down"), [h, ffn]),
    ]
}

/// The projections of DeltaNet layer `i` (Qwen3.5), as [`layer_matrices`]: the mixed q/k/v,
/// the output gate, β, α and the output.
fn delta_net_matrices(cfg: &Config, i: usize) -> Option<[(String, [usize; 2]); 5]> {
    let r = cfg.recurrent.as_ref().filter(|_| cfg.is_recurrent(i))?;
    let (h, v) = (cfg.hidden, r.value_dim());
    let p = format!("blk.{i}");
    Some([
        (format!("{p}.attn_qkv"), [r.channels(), h]),
        (format!("{p}.attn_gate"), [v, h]),
        (format!("{p}.ssm_beta"), [r.v_heads, h]),
        (format!("{p}.ssm_alpha"), [r.v_heads, h]),
        (format!("{p}.ssm_out"), [h, v]),
    ])
}

impl GgufFile {
    /// A small tensor of shape `dims` (sink logits, expert biases) as f32 values on the host,
    /// every one finite.
    fn values(&mut self, name: &str, dims: &[usize], device: &Device) -> Result<Vec<f32>> {
        let v = self.dense(name, device)?;
        expect_dims(name, v.dims(), dims)?;
        let v: Vec<f32> = v.flatten_all()?.to_vec1()?;
        if let Some(x) = v.iter().find(|x| !x.is_finite()) {
            bail!(
                "tensor {name} in {} holds {x}, not a number a model can use; is the file damaged?",
                self.path.display()
            );
        }
        Ok(v)
    }

    /// Layer `p`'s Gated DeltaNet (Qwen3.5): its matrices `m` (from [`delta_net_matrices`]) and
    /// small tensors, each checked for shape and finite values.
    fn delta_net(
        &mut self,
        p: &str,
        cfg: &Config,
        m: [(String, [usize; 2]); 5],
        device: &Device,
    ) -> Result<DeltaNet> {
        let r = cfg
            .recurrent
            .as_ref()
            .context("a DeltaNet layer without its sizes")?;
        let [qkv, gate, beta, alpha, out] = m;
        // [C][conv] in the file; tap-major for the kernel.
        let taps = self.values(
            &format!("{p}.ssm_conv1d.weight"),
            &[r.channels(), r.conv],
            device,
        )?;
        let conv = (0..r.conv)
            .flat_map(|k| (0..r.channels()).map(move |c| (c, k)))
            .map(|(c, k)| taps[c * r.conv + k])
            .collect();
        let mut d = DeltaNet {
            input: None,
            qkv: self.linear(&qkv.0, false, qkv.1, device)?,
            gate: self.linear(&gate.0, false, gate.1, device)?,
            beta: self.linear(&beta.0, false, beta.1, device)?,
            alpha: self.linear(&alpha.0, false, alpha.1, device)?,
            conv,
            dt_bias: self.values(&format!("{p}.ssm_dt.bias"), &[r.v_heads], device)?,
            a: self.values(&format!("{p}.ssm_a"), &[r.v_heads], device)?,
            norm: self.values(&format!("{p}.ssm_norm.weight"), &[r.head_dim], device)?,
            out: self.linear(&out.0, false, out.1, device)?,
        };
        d.stack_projections()?;
        Ok(d)
    }

    /// Layer `p`'s mixture of experts (gpt-oss): the router, and each expert's rows of the
    /// `[n_expert, rows, cols]` tensors `ffn_{gate,up,down}_exps` read as matrices of their own
    /// (each expert's bytes are contiguous in the file), its gate and up stacked; the biases
    /// `ffn_*_exps.bias` where the file has them. The experts run on our CPU kernels only.
    fn moe(&mut self, p: &str, cfg: &Config, device: &Device) -> Result<Moe> {
        let e = cfg
            .experts
            .context("a mixture-of-experts block without expert sizes")?;
        let (h, f, n) = (cfg.hidden, e.ffn, e.count);
        let router_bias = self.has_tensor(&format!("{p}.ffn_gate_inp.bias"));
        let router = self.linear(&format!("{p}.ffn_gate_inp"), router_bias, [n, h], device)?;
        // The experts stay in host memory on any device (on a GPU the rest of the block runs
        // there: llama.cpp's --cpu-moe).
        if self.dense.is_some() {
            bail!(
                "{}: its experts run on kvchat's CPU kernels only, with their weights as stored: a mixture-of-experts model cannot be dequantized to another dtype",
                self.path.display()
            );
        }
        // Gate and up apart, or stacked per expert in the file (`ffn_gate_up_exps`: Gemma 4).
        let fused = self.has_tensor(&format!("{p}.ffn_gate_up_exps.weight"));
        let kinds: &[(&str, usize, usize)] = match fused {
            true => &[("gate_up", 2 * f, h), ("down", h, f)],
            false => &[("gate", f, h), ("up", f, h), ("down", h, f)],
        };
        let k = kinds.len();
        let mut parts = Vec::with_capacity(k * n);
        let mut names = Vec::with_capacity(k * n);
        for &(which, rows, cols) in kinds {
            let name = format!("{p}.ffn_{which}_exps.weight");
            let info =
                self.content.tensor_infos.get(&name).ok_or_else(|| {
                    self.unreadable(&name, "the file has no such tensor".to_string())
                })?;
            expect_dims(&name, info.shape.dims(), &[n, rows, cols])?;
            let ty = self.expert_type(&name)?;
            let all = self.locate_as(&name, ty, n * rows, cols)?;
            let size = all.size / n as u64;
            for x in 0..n {
                names.push(format!("{name}#{x}"));
                parts.push(Located {
                    dtype: ty,
                    rows,
                    cols,
                    start: all.start + x as u64 * size,
                    size,
                });
            }
        }
        // Gate and up of each expert end to end in the store, so stacking them copies nothing.
        let order: Vec<usize> = match fused {
            true => (0..2 * n).collect(),
            false => (0..n)
                .flat_map(|x| [x, n + x])
                .chain(2 * n..3 * n)
                .collect(),
        };
        let found: Vec<(&str, Located)> = order
            .iter()
            .map(|&i| (names[i].as_str(), parts[i].clone()))
            .collect();
        let mut read = self.read_located(&found)?;
        let mut take = |i: usize| {
            read.remove(&names[i])
                .with_context(|| format!("{} was not read for the experts", names[i]))
        };
        let bias = |me: &mut Self, which: &str, len: usize| -> Result<Option<Vec<f32>>> {
            let name = format!("{p}.ffn_{which}_exps.bias");
            me.has_tensor(&name)
                .then(|| me.values(&name, &[n, len], device))
                .transpose()
        };
        let (bg, bu, bd) = (
            bias(self, "gate", f)?,
            bias(self, "up", f)?,
            bias(self, "down", h)?,
        );
        let scales = {
            let name = format!("{p}.ffn_down_exps.scale");
            match self.has_tensor(&name) {
                true => Some(self.values(&name, &[n], device)?),
                false => None,
            }
        };
        let mut experts = Vec::with_capacity(n);
        for x in 0..n {
            let (gate_up, down) = match fused {
                true => (GateUp::Stacked(take(x)?), take(n + x)?),
                false => {
                    let (gate, up, down) = (take(x)?, take(n + x)?, take(2 * n + x)?);
                    let gate_up = match QMatrix::stack(&[&gate, &up])? {
                        Some((all, _)) => GateUp::Stacked(all),
                        None => GateUp::Apart(gate, up),
                    };
                    (gate_up, down)
                }
            };
            let slice = |b: &Option<Vec<f32>>, len: usize| {
                b.as_ref()
                    .map_or_else(|| vec![0f32; len], |b| b[x * len..][..len].to_vec())
            };
            let mut gate_up_b = slice(&bg, f);
            gate_up_b.extend(slice(&bu, f));
            experts.push(Expert {
                gate_up,
                gate_up_b,
                down,
                down_b: slice(&bd, h),
                scale: scales.as_ref().map_or(1.0, |s| s[x]),
            });
        }
        // A shared expert every token runs, gated by sigmoid(gate·x) (Qwen3.5 MoE).
        let shared = match self.has_tensor(&format!("{p}.ffn_gate_inp_shexp.weight")) {
            true => {
                let fs = e.shared.max(1);
                let mut ours = |which: &str, want: [usize; 2]| -> Result<QMatrix> {
                    self.host_matrix(&format!("{p}.ffn_{which}_shexp.weight"), want)
                };
                let (gate, up, down) = (
                    ours("gate", [fs, h])?,
                    ours("up", [fs, h])?,
                    ours("down", [h, fs])?,
                );
                let gate_up = match QMatrix::stack(&[&gate, &up])? {
                    Some((all, _)) => GateUp::Stacked(all),
                    None => GateUp::Apart(gate, up),
                };
                Some(SharedExpert {
                    gate_up,
                    down,
                    gate: self.values(&format!("{p}.ffn_gate_inp_shexp.weight"), &[h], device)?,
                    ffn: fs,
                })
            }
            false => None,
        };
        if shared.is_none() && e.shared > 0 {
            bail!(
                "{}: {p} has no shared expert (ffn_gate_inp_shexp) though the metadata gives it {} rows",
                self.path.display(),
                e.shared
            );
        }
        Ok(Moe {
            router,
            experts,
            used: e.used,
            ffn: f,
            act: cfg.pieces.act,
            shared,
        })
    }

    /// A matrix for kvchat's CPU kernels whatever the device and `--kernels` (a mixture's shared
    /// expert runs beside the routed ones, on the host).
    fn host_matrix(&mut self, name: &str, want: [usize; 2]) -> Result<QMatrix> {
        if let Some(m) = self.packed.remove(name) {
            return Ok(m);
        }
        let Some((rows, cols, _)) = self.dims2(name)? else {
            bail!("tensor {name} in {} is not a matrix", self.path.display());
        };
        let ty = self.expert_type(name)?;
        expect_dims(name, &[rows, cols], &want)?;
        let at = self.locate_as(name, ty, rows, cols)?;
        self.read_located(&[(name, at)])?
            .remove(name)
            .with_context(|| format!("{name} was not read for the shared expert"))
    }

    /// The type of expert tensor `name`, refused in one line where kvchat's expert kernels cannot
    /// run it (the file's own check refuses such types at open; this keeps the experts' promise
    /// where they are read).
    fn expert_type(&self, name: &str) -> Result<WeightType> {
        let ty = self.tensor_type(name).unwrap_or(PLACEHOLDER);
        if !crate::model::kernels::quant::FORMATS.contains(&ty) {
            bail!(
                "tensor {name} in {} has {ty}, which kvchat's expert kernels cannot run",
                self.path.display()
            );
        }
        Ok(ty)
    }

    /// A dense f32 tensor (norm weights, biases), dequantized if stored quantized.
    fn dense(&mut self, name: &str, device: &Device) -> Result<Tensor> {
        Ok(self.tensor(name, device)?.dequantize(device)?)
    }

    fn linear(
        &mut self,
        name: &str,
        bias: bool,
        want: [usize; 2],
        device: &Device,
    ) -> Result<Linear> {
        let wname = format!("{name}.weight");
        let w = match self.matrix(&wname, want, device)? {
            Read::Ours(m) => Weight::Cpu(m),
            Read::Candle(t) => self.weight(t, device)?,
        };
        let b = if bias {
            Some(self.dense(&format!("{name}.bias"), device)?)
        } else {
            None
        };
        Ok(Linear { w, b })
    }

    /// A matrix read by candle as the decoder uses it: candle's quantized matmul, or dequantized
    /// to `self.dense`.
    fn weight(&self, w: Arc<QTensor>, device: &Device) -> Result<Weight> {
        Ok(match self.dense {
            Some(dtype) => Weight::Dense(w.dequantize(device)?.to_dtype(dtype)?),
            None => Weight::Quantized(QMatMul::from_arc(w)?),
        })
    }

    /// A matrix `[rows, cols]` = `want`: read for our kernels by [`GgufFile::pack_all`] where
    /// they run it, else by candle.
    fn matrix(&mut self, name: &str, want: [usize; 2], device: &Device) -> Result<Read> {
        if let Some(m) = self.packed.remove(name) {
            return Ok(Read::Ours(m));
        }
        // Not packed: candle's, or one whose check failed (reported here, in load order).
        if let Some(at) = self.locate(name, want, device)? {
            if let Some(m) = self.read_located(&[(name, at)])?.remove(name) {
                return Ok(Read::Ours(m));
            }
        }
        let t = self.tensor(name, device)?;
        expect_dims(name, t.shape().dims(), &want)?;
        Ok(Read::Candle(Arc::new(t)))
    }

    /// Whether layer `i`'s decoder reads the matrix `name`: not the keys' and values' of a layer
    /// sharing an earlier one's (Gemma 4), nor values a Gemma 4 layer takes from its keys'
    /// projection when the file has none.
    fn layer_reads(&self, cfg: &Config, i: usize, name: &str) -> bool {
        let kv = name.ends_with(".attn_k.weight") || name.ends_with(".attn_v.weight");
        let v_from_k =
            cfg.pieces.v_norm && name.ends_with(".attn_v.weight") && !self.has_tensor(name);
        let shared = kv && !cfg.own_kv(i);
        !shared && !v_from_k
    }

    /// The hyperparameters in this file's metadata.
    pub fn config(&self) -> Result<Config> {
        Config::from_gguf(&self.content)
            .with_context(|| format!("model file {}", self.path.display()))
    }

    /// Builds the decoder. `max_positions` sizes the RoPE table (the most positions a run may reach).
    pub fn load_decoder(&mut self, device: &Device, max_positions: usize) -> Result<Decoder> {
        let cfg = self.config()?;
        self.load_decoder_with(cfg, device, max_positions)
    }

    /// Builds the decoder from hyperparameters already read with [`GgufFile::config`].
    pub fn load_decoder_with(
        &mut self,
        cfg: Config,
        device: &Device,
        max_positions: usize,
    ) -> Result<Decoder> {
        let h = cfg.hidden;
        // Every matrix our kernels run, read first into one store (q, k, v and gate, up end to
        // end there, so stacking them below copies nothing).
        let mut wanted = vec![("token_embd.weight".to_string(), [cfg.vocab, h])];
        for i in 0..cfg.n_layer {
            // A mixture of experts has no dense FFN matrices (its experts are read below); a
            // DeltaNet layer has its own instead of attention's.
            let (skip, n) = match (cfg.is_recurrent(i), cfg.pieces.moe) {
                (true, true) => (4, 0),
                (true, false) => (4, 3),
                (false, true) => (0, 4),
                (false, false) => (0, 7),
            };
            wanted.extend(
                layer_matrices(&cfg, i)
                    .into_iter()
                    .skip(skip)
                    .take(n)
                    .chain(delta_net_matrices(&cfg, i).into_iter().flatten())
                    .map(|(p, want)| (format!("{p}.weight"), want))
                    .filter(|(name, _)| self.layer_reads(&cfg, i, name)),
            );
            if cfg.per_layer_embd > 0 {
                let ple = cfg.per_layer_embd;
                wanted.push((format!("blk.{i}.inp_gate.weight"), [ple, h]));
                wanted.push((format!("blk.{i}.proj.weight"), [h, ple]));
            }
        }
        let ple_all = cfg.n_layer * cfg.per_layer_embd;
        if ple_all > 0 {
            wanted.push(("per_layer_token_embd.weight".into(), [cfg.vocab, ple_all]));
            wanted.push(("per_layer_model_proj.weight".into(), [ple_all, h]));
        }
        if self.has_tensor("output.weight") {
            wanted.push(("output.weight".to_string(), [cfg.vocab, h]));
        }
        self.pack_all(&wanted, device)?;
        // The table in our kernels' store when they run its type (no dequantized copy; with tied
        // embeddings, the output matrix is the same store); else candle's tensor.
        let embed = self.matrix("token_embd.weight", [cfg.vocab, h], device)?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        let block = cfg.pieces;
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            let qkv_bias = self.has_tensor(&format!("{p}.attn_q.bias"));
            // A norm weight the architecture's block uses, of `n` values.
            let mut norm = |used: bool, name: &str, n: usize| -> Result<Option<Tensor>> {
                if !used {
                    return Ok(None);
                }
                let name = format!("{p}.{name}.weight");
                let w = self.dense(&name, device)?;
                expect_dims(&name, w.dims(), &[n])?;
                Ok(Some(w))
            };
            let hd = cfg.layer_kv_shape(i).1;
            let own_kv = cfg.own_kv(i);
            let attends = !cfg.is_recurrent(i);
            let q_norm = norm(block.qk_norm && attends, "attn_q_norm", hd)?;
            let k_norm = norm(block.qk_norm && own_kv, "attn_k_norm", hd)?;
            let post_attn_norm = norm(block.post_norms, "post_attention_norm", h)?;
            let post_ffn_norm = norm(block.post_norms, "post_ffw_norm", h)?;
            let [q, k, v, o, gate, up, down] = layer_matrices(&cfg, i);
            let o_bias = self.has_tensor(&format!("{p}.attn_output.bias"));
            let sinks = match block.attn_sinks && attends {
                true => {
                    Some(self.values(&format!("{p}.attn_sinks.weight"), &[cfg.n_head], device)?)
                }
                false => None,
            };
            let ffn = if block.moe {
                Ffn::Moe(self.moe(&p, &cfg, device)?)
            } else {
                Ffn::Dense {
                    gate_up: None,
                    gate: self.linear(&gate.0, false, gate.1, device)?,
                    up: self.linear(&up.0, false, up.1, device)?,
                    down: self.linear(&down.0, false, down.1, device)?,
                }
            };
            let wk = match own_kv && attends {
                true => Some(self.linear(&k.0, qkv_bias, k.1, device)?),
                false => None,
            };
            let wv = match own_kv && self.layer_reads(&cfg, i, &format!("{}.weight", v.0)) {
                true => Some(self.linear(&v.0, qkv_bias, v.1, device)?),
                false => None,
            };
            let out_scale = match block.out_scale {
                true => {
                    let name = format!("{p}.layer_output_scale.weight");
                    match self.has_tensor(&name) {
                        true => Some(self.values(&name, &[1], device)?[0]),
                        false => None,
                    }
                }
                false => None,
            };
            let per_layer = match cfg.per_layer_embd {
                0 => None,
                ple => Some(PerLayerBlock {
                    gate: self.linear(&format!("{p}.inp_gate"), false, [ple, h], device)?,
                    proj: self.linear(&format!("{p}.proj"), false, [h, ple], device)?,
                    post_norm: {
                        let name = format!("{p}.post_norm.weight");
                        let w = self.dense(&name, device)?;
                        expect_dims(&name, w.dims(), &[h])?;
                        w
                    },
                }),
            };
            // Experts beside the dense FFN, on the layers that have a router (Gemma 4 26B-A4B).
            let moe_beside = match cfg.experts.is_some()
                && !block.moe
                && self.has_tensor(&format!("{p}.ffn_gate_inp.weight"))
            {
                true => {
                    let mut norm = |name: &str| -> Result<Tensor> {
                        let name = format!("{p}.{name}");
                        let w = self.dense(&name, device)?;
                        expect_dims(&name, w.dims(), &[h])?;
                        Ok(w)
                    };
                    let scale = norm("ffn_gate_inp.scale")?;
                    Some(MoeBeside {
                        post_norm_dense: norm("post_ffw_norm_1.weight")?,
                        pre_norm: norm("pre_ffw_norm_2.weight")?,
                        post_norm: norm("post_ffw_norm_2.weight")?,
                        router_scale: (scale / (h as f64).sqrt())?,
                        moe: self.moe(&p, &cfg, device)?,
                    })
                }
                false => None,
            };
            let mixer = match delta_net_matrices(&cfg, i) {
                Some(m) => Mixer::DeltaNet(self.delta_net(&p, &cfg, m, device)?),
                None => Mixer::Attention(Attention {
                    qkv: None,
                    wq: self.linear(&q.0, qkv_bias, q.1, device)?,
                    wk,
                    wv,
                    wo: self.linear(&o.0, o_bias, o.1, device)?,
                    v_norm: match block.v_norm {
                        true => Some(Tensor::ones(hd, DType::F32, device)?),
                        false => None,
                    },
                    sinks,
                    q_norm,
                    k_norm,
                }),
            };
            let mut layer = Block {
                moe_beside,
                attn_norm: self.dense(&format!("{p}.attn_norm.weight"), device)?,
                mixer,
                out_scale,
                per_layer,
                ffn_norm: self.dense(&format!("{p}.{}.weight", block.ffn_norm), device)?,
                ffn,
                post_attn_norm,
                post_ffn_norm,
            };
            layer.stack_projections()?;
            layers.push(layer);
        }
        let norm = self.dense("output_norm.weight", device)?;
        // Tied embeddings: with no output.weight, the output projection is the embedding matrix.
        let output = if self.has_tensor("output.weight") {
            self.linear("output", false, [cfg.vocab, h], device)?
        } else {
            Linear {
                w: match &embed {
                    Read::Ours(m) => Weight::Cpu(m.clone()),
                    Read::Candle(t) => self.weight(t.clone(), device)?,
                },
                b: None,
            }
        };
        let freq_factors = if self.has_tensor("rope_freqs.weight") {
            Some(self.dense("rope_freqs.weight", device)?.to_vec1::<f32>()?)
        } else {
            None
        };
        let rope = Rope::new(
            &cfg,
            max_positions,
            freq_factors.as_deref(),
            DType::F32,
            device,
        )?;
        let rope_local = Rope::local(&cfg, max_positions, DType::F32, device)?;
        let per_layer = match cfg.n_layer * cfg.per_layer_embd {
            0 => None,
            all => Some(PerLayerEmbeddings {
                table: match self.matrix("per_layer_token_embd.weight", [cfg.vocab, all], device)? {
                    Read::Ours(m) => Embedding::Cpu(m),
                    Read::Candle(t) => Embedding::Quantized(t),
                },
                model_proj: self.linear("per_layer_model_proj", false, [all, h], device)?,
                proj_norm: {
                    let w = self.dense("per_layer_proj_norm.weight", device)?;
                    expect_dims(
                        "per_layer_proj_norm.weight",
                        w.dims(),
                        &[cfg.per_layer_embd],
                    )?;
                    w
                },
            }),
        };
        let embed = match embed {
            Read::Ours(m) => Embedding::Cpu(m),
            Read::Candle(t) => match (t.dtype(), self.dense) {
                (_, Some(dtype)) => Embedding::Dense(t.dequantize(device)?.to_dtype(dtype)?),
                (candle_core::quantized::GgmlDType::F32, None) => {
                    Embedding::Dense(t.dequantize(device)?)
                }
                _ => Embedding::Quantized(t),
            },
        };
        Ok(Decoder {
            cfg,
            embed,
            layers,
            norm,
            output,
            per_layer,
            rope,
            rope_local,
            device: device.clone(),
            prefill_chunk: crate::model::decoder::PREFILL_CHUNK,
        })
    }
}
