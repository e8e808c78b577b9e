//! `--kv-quant int8`: keys and values held as INT8, what stays resident is a quarter of f32.
//!
//! KIVI's finding (arXiv 2402.02750): keys have outlier *channels*, values do not. So keys get one f32
//! scale per (channel, head) over a group of `GROUP` tokens, values one f32 scale per (token, head);
//! both symmetric (`q = round(x / s)`, `s = max|x| / 127`). The most recent `residual` positions (and
//! the positions of a key group not yet complete) stay in f32 and are quantized as they age out.
//! Keys are quantized after RoPE. Attention reads the INT8 storage directly (no dequantized copy):
//! see `model::kernels::attention::attend_int8`.
//!
//! Layout per KV head: `kq`, `vq` `[n_quantized, hd]` i8; `k_scale` `[n_quantized / GROUP, hd]`;
//! `v_scale` `[n_quantized]`; `tail_k`, `tail_v` `[n_tail, hd]` f32, positions in order.

use super::{Attend, KvView, LayerCache};
pub use crate::model::cache::{Int8Head, Int8View, GROUP};
use crate::model::rope::Rope;
use anyhow::Result;
use candle_core::{Device, Tensor};

pub struct Int8Cache {
    n_kv_heads: usize,
    head_dim: usize,
    max_positions: usize,
    residual: usize,
    heads: Vec<Int8Head>,
    n_quant: usize,
    n_tail: usize,
}

fn quantize_symmetric(xs: &[f32], scale: f32) -> impl Iterator<Item = i8> + '_ {
    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
    xs.iter()
        .map(move |x| (x * inv).round().clamp(-127.0, 127.0) as i8)
}

impl Int8Cache {
    pub fn new(n_kv_heads: usize, head_dim: usize, max_positions: usize, residual: usize) -> Self {
        Self {
            n_kv_heads,
            head_dim,
            max_positions,
            residual,
            heads: vec![Int8Head::default(); n_kv_heads],
            n_quant: 0,
            n_tail: 0,
        }
    }

    /// Quantizes the oldest GROUP tail positions of every head.
    fn quantize_group(&mut self) {
        let hd = self.head_dim;
        for h in &mut self.heads {
            // Exact reservations: what is resident is what is used, not a doubled Vec.
            h.kq.reserve_exact(GROUP * hd);
            h.vq.reserve_exact(GROUP * hd);
            h.k_scale.reserve_exact(hd);
            h.v_scale.reserve_exact(GROUP);
            let k = &h.tail_k[..GROUP * hd];
            let v = &h.tail_v[..GROUP * hd];
            // Keys: one scale per channel over the group.
            let mut ks = vec![0f32; hd];
            for row in k.chunks_exact(hd) {
                for (s, x) in ks.iter_mut().zip(row) {
                    *s = s.max(x.abs());
                }
            }
            ks.iter_mut().for_each(|s| *s /= 127.0);
            for row in k.chunks_exact(hd) {
                h.kq.extend(row.iter().zip(&ks).map(|(x, s)| {
                    if *s > 0.0 {
                        (x / s).round().clamp(-127.0, 127.0) as i8
                    } else {
                        0
                    }
                }));
            }
            h.k_scale.extend_from_slice(&ks);
            // Values: one scale per token.
            for row in v.chunks_exact(hd) {
                let s = row.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
                h.vq.extend(quantize_symmetric(row, s));
                h.v_scale.push(s);
            }
            h.tail_k.drain(..GROUP * hd);
            h.tail_v.drain(..GROUP * hd);
        }
        self.n_quant += GROUP;
        self.n_tail -= GROUP;
    }

    /// Dequantized keys and values of positions `0..n_quant` of head `h` (for `state` and `truncate`).
    fn dequantized(&self, h: &Int8Head) -> (Vec<f32>, Vec<f32>) {
        let hd = self.head_dim;
        let mut k = Vec::with_capacity(self.n_quant * hd);
        let mut v = Vec::with_capacity(self.n_quant * hd);
        for (j, (kr, vr)) in h.kq.chunks_exact(hd).zip(h.vq.chunks_exact(hd)).enumerate() {
            let ks = &h.k_scale[(j / GROUP) * hd..][..hd];
            k.extend(kr.iter().zip(ks).map(|(q, s)| *q as f32 * s));
            v.extend(vr.iter().map(|q| *q as f32 * h.v_scale[j]));
        }
        (k, v)
    }
}

impl LayerCache for Int8Cache {
    fn append(&mut self, k: &Tensor, v: &Tensor, rope: &Rope) -> Result<Attend<'_>> {
        if !k.device().is_cpu() {
            return Err(crate::fixable(
                crate::Fix::CpuDevice,
                "the int8 KV cache runs on the CPU device only".into(),
            ));
        }
        let t = k.dim(2)?;
        let pos = self.n_quant + self.n_tail;
        if pos + t > self.max_positions {
            return Err(crate::fixable(
                crate::Fix::RaiseContext,
                format!(
                    "the KV cache is full: {} positions needed, {} allowed",
                    pos + t,
                    self.max_positions
                ),
            ));
        }
        // Age out: whole key groups beyond the residual window are quantized.
        while self.n_tail >= self.residual + GROUP {
            self.quantize_group();
        }
        let k = rope.apply(k, pos)?.to_device(&Device::Cpu)?; // [1, nkv, t, hd]
        let v = v.to_device(&Device::Cpu)?;
        for (h, head) in self.heads.iter_mut().enumerate() {
            head.tail_k.reserve_exact(t * self.head_dim);
            head.tail_v.reserve_exact(t * self.head_dim);
            head.tail_k
                .extend(k.get(0)?.get(h)?.flatten_all()?.to_vec1::<f32>()?);
            head.tail_v
                .extend(v.get(0)?.get(h)?.flatten_all()?.to_vec1::<f32>()?);
        }
        self.n_tail += t;
        Ok(Attend {
            view: KvView::Int8(Int8View {
                heads: &self.heads,
                head_dim: self.head_dim,
                n_quant: self.n_quant,
                n_tail: self.n_tail,
            }),
            q_pos: pos,
        })
    }

    fn len(&self) -> usize {
        self.n_quant + self.n_tail
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        let hd = self.head_dim;
        if len >= self.len() {
            return Ok(());
        }
        if len >= self.n_quant {
            for h in &mut self.heads {
                h.tail_k.truncate((len - self.n_quant) * hd);
                h.tail_v.truncate((len - self.n_quant) * hd);
            }
            self.n_tail = len - self.n_quant;
            return Ok(());
        }
        // Back into the quantized part: keep whole groups below len, the rest of len in f32 again.
        let keep = len / GROUP * GROUP;
        for i in 0..self.heads.len() {
            let (dk, dv) = self.dequantized(&self.heads[i]);
            let h = &mut self.heads[i];
            h.kq.truncate(keep * hd);
            h.vq.truncate(keep * hd);
            h.k_scale.truncate(keep / GROUP * hd);
            h.v_scale.truncate(keep);
            h.tail_k = dk[keep * hd..len * hd].to_vec();
            h.tail_v = dv[keep * hd..len * hd].to_vec();
        }
        self.n_quant = keep;
        self.n_tail = len - keep;
        Ok(())
    }

    fn bytes(&self) -> usize {
        self.heads
            .iter()
            .map(|h| {
                h.kq.capacity()
                    + h.vq.capacity()
                    + 4 * (h.k_scale.capacity()
                        + h.v_scale.capacity()
                        + h.tail_k.capacity()
                        + h.tail_v.capacity())
            })
            .sum()
    }

    fn bytes_used(&self) -> usize {
        self.heads
            .iter()
            .map(|h| {
                h.kq.len()
                    + h.vq.len()
                    + 4 * (h.k_scale.len() + h.v_scale.len() + h.tail_k.len() + h.tail_v.len())
            })
            .sum()
    }

    fn state(&self) -> Result<Option<(Tensor, Tensor)>> {
        if self.len() == 0 {
            return Ok(None);
        }
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for h in &self.heads {
            let (dk, dv) = self.dequantized(h);
            ks.extend(dk);
            ks.extend_from_slice(&h.tail_k);
            vs.extend(dv);
            vs.extend_from_slice(&h.tail_v);
        }
        let shape = (1, self.n_kv_heads, self.len(), self.head_dim);
        Ok(Some((
            Tensor::from_vec(ks, shape, &Device::Cpu)?,
            Tensor::from_vec(vs, shape, &Device::Cpu)?,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Config, RopeStyle};
    use crate::model::kernels::attention::{attend, attend_view};

    fn rope() -> Rope {
        let cfg = Config {
            arch: "llama".into(),
            n_layer: 1,
            n_head: 4,
            n_kv_head: 2,
            head_dim: 64,
            hidden: 256,
            ffn: 512,
            vocab: 10,
            ctx_train: 1024,
            rope_base: 10000.0,
            rope_dim: 64,
            rope_linear_scale: 1.0,
            rope_style: RopeStyle::Interleaved,
            rms_eps: 1e-6,
        };
        Rope::new(&cfg, 1024, None, candle_core::DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn int8_attention_equals_dense_attention_over_the_dequantized_cache() {
        let dev = Device::Cpu;
        let rope = rope();
        let mut c = Int8Cache::new(2, 64, 1024, 8);
        let kv = |t: usize| {
            (
                Tensor::randn(0f32, 1.0, (1, 2, t, 64), &dev).unwrap(),
                Tensor::randn(0f32, 1.0, (1, 2, t, 64), &dev).unwrap(),
            )
        };
        let (k, v) = kv(300);
        c.append(&k, &v, &rope).unwrap();
        let (k, v) = kv(3);
        let n_before = c.len();
        // The next step quantizes groups, then appends 3 positions; compare its view with dense.
        let q = Tensor::randn(0f32, 1.0, (2, 2 * 3, 64), &dev).unwrap();
        let fused = {
            let att = c.append(&k, &v, &rope).unwrap();
            match &att.view {
                KvView::Int8(iv) => assert!(iv.n_quant >= GROUP, "nothing quantized"),
                _ => panic!("int8 cache returned a dense view"),
            }
            attend_view(&q, &att.view, 3, 0.125).unwrap()
        };
        assert_eq!(c.len(), n_before + 3);
        let (dk, dv) = c.state().unwrap().unwrap();
        let dense = attend(
            &dk.squeeze(0).unwrap(),
            &dv.squeeze(0).unwrap(),
            &q,
            3,
            0.125,
        )
        .unwrap();
        let d: f32 = (fused - dense)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!(d < 1e-4, "differs by {d}");
    }

    #[test]
    fn quantization_error_is_within_half_a_step() {
        let dev = Device::Cpu;
        let rope = rope();
        let mut c = Int8Cache::new(2, 64, 1024, 0);
        let k = Tensor::randn(0f32, 1.0, (1, 2, GROUP, 64), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (1, 2, GROUP, 64), &dev).unwrap();
        c.append(&k, &v, &rope).unwrap();
        c.append(
            &k.narrow(2, 0, 1).unwrap(),
            &v.narrow(2, 0, 1).unwrap(),
            &rope,
        )
        .unwrap();
        assert_eq!(c.n_quant, GROUP);
        let (_, dv) = c.state().unwrap().unwrap();
        let dv = dv.narrow(2, 0, GROUP).unwrap();
        // Per-token scale: error ≤ max|v_token| / 127 / 2.
        let err = (dv - &v).unwrap().abs().unwrap();
        let bound = (v.abs().unwrap().max_keepdim(3).unwrap() / 254.0).unwrap();
        let over: f32 = err
            .broadcast_sub(&bound)
            .unwrap()
            .max_keepdim(3)
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!(over <= 1e-6, "{over}");
    }
}
