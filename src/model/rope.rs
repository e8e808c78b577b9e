//! Rotary position embeddings, applied to [b, heads, t, head_dim] from a cos/sin table that grows
//! as positions are reached (doubling, up to the context): a model with a 32k context and two
//! bases (Gemma 3) would spend 0.17 s of its load on 8 M sin/cos that a short chat never reads.

use super::config::{Config, RopeStyle};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, D};
use std::sync::Mutex;

/// Positions in the first table; it doubles from there when a step reaches past it.
const FIRST_TABLE: usize = 1024;

pub struct Rope {
    /// cos and sin of the first `len` positions, each [len, rope_dim / 2].
    table: Mutex<Table>,
    dtype: DType,
    device: Device,
    style: RopeStyle,
    rope_dim: usize,
    head_dim: usize,
    max_positions: usize,
    inv_freq: Vec<f32>,
    linear_scale: f32,
}

impl Rope {
    /// `freq_factors` (GGUF `rope_freqs.weight`, Llama 3 style) divide the base frequencies when present.
    pub fn new(
        cfg: &Config,
        max_positions: usize,
        freq_factors: Option<&[f32]>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::with_base(
            cfg,
            (cfg.rope_base, cfg.rope_linear_scale),
            max_positions,
            freq_factors,
            dtype,
            device,
        )
    }

    /// The rotation of the model's sliding-window layers when they have a base of their own
    /// (`Config::rope_base_local`: no scaling, no frequency factors); None when they do not.
    pub fn local(
        cfg: &Config,
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Self>> {
        cfg.rope_base_local
            .map(|base| Self::with_base(cfg, (base, 1.0), max_positions, None, dtype, device))
            .transpose()
    }

    fn with_base(
        cfg: &Config,
        (rope_base, linear_scale): (f32, f32),
        max_positions: usize,
        freq_factors: Option<&[f32]>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let half = cfg.rope_dim / 2;
        if let Some(f) = freq_factors {
            if f.len() != half {
                bail!("rope_freqs has {} entries, expected {half}", f.len());
            }
        }
        let inv_freq: Vec<f32> = (0..half)
            .map(|i| {
                let base = 1.0 / rope_base.powf(2.0 * i as f32 / cfg.rope_dim as f32);
                base / freq_factors.map_or(1.0, |f| f[i])
            })
            .collect();
        let empty = Tensor::zeros((0, half), dtype, device)?;
        Ok(Self {
            table: Mutex::new(Table {
                cos: empty.clone(),
                sin: empty,
                len: 0,
            }),
            dtype,
            device: device.clone(),
            style: cfg.rope_style,
            rope_dim: cfg.rope_dim,
            head_dim: cfg.head_dim,
            max_positions,
            inv_freq,
            linear_scale,
        })
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// cos and sin of positions `pos .. pos + t`, each [t, rope_dim / 2]: rows of the table, grown
    /// first if the step reaches past it; past `max_positions` (a window runs past the context)
    /// computed for the step alone. Every value is `angles`' whichever way it is reached.
    fn rows(&self, pos: usize, t: usize) -> Result<(Tensor, Tensor)> {
        let end = pos + t;
        if end > self.max_positions {
            return self.angles(pos, end);
        }
        let mut table = self.table.lock().unwrap_or_else(|e| e.into_inner());
        if end > table.len {
            let len = end
                .max(2 * table.len)
                .max(FIRST_TABLE)
                .min(self.max_positions);
            let (cos, sin) = self.angles(0, len)?;
            *table = Table { cos, sin, len };
        }
        Ok((table.cos.narrow(0, pos, t)?, table.sin.narrow(0, pos, t)?))
    }

    /// cos and sin of positions `from .. to`, [to - from, rope_dim / 2] each.
    fn angles(&self, from: usize, to: usize) -> Result<(Tensor, Tensor)> {
        let n = to - from;
        let (mut cos, mut sin) = (Vec::with_capacity(n * self.inv_freq.len()), Vec::new());
        sin.reserve(n * self.inv_freq.len());
        for p in from..to {
            let p = p as f32 / self.linear_scale;
            for f in &self.inv_freq {
                let (s, c) = (p * f).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        let shape = (n, self.inv_freq.len());
        Ok((
            Tensor::from_vec(cos, shape, &self.device)?.to_dtype(self.dtype)?,
            Tensor::from_vec(sin, shape, &self.device)?.to_dtype(self.dtype)?,
        ))
    }

    /// Rotates `x` [b, heads, t, head_dim] as if its t tokens sat at positions `pos .. pos + t`.
    /// Positions past the table (a window runs past the context) are computed the table's way.
    pub fn apply(&self, x: &Tensor, pos: usize) -> Result<Tensor> {
        let (_b, _h, t, d) = x.dims4()?;
        debug_assert_eq!(d, self.head_dim);
        let (cos, sin) = self.rows(pos, t)?; // [t, rope_dim/2] each
        let rotate = |x: &Tensor| -> Result<Tensor> {
            let x = x.contiguous()?;
            Ok(match self.style {
                RopeStyle::Interleaved => candle_nn::rotary_emb::rope_i(&x, &cos, &sin)?,
                RopeStyle::HalfSplit => candle_nn::rotary_emb::rope(&x, &cos, &sin)?,
            })
        };
        if self.rope_dim == self.head_dim {
            return rotate(x);
        }
        // Partial rotary: only the first rope_dim dimensions of each head turn.
        let rot = rotate(&x.narrow(D::Minus1, 0, self.rope_dim)?)?;
        let pass = x.narrow(D::Minus1, self.rope_dim, self.head_dim - self.rope_dim)?;
        Ok(Tensor::cat(&[&rot, &pass], D::Minus1)?)
    }
}

struct Table {
    cos: Tensor,
    sin: Tensor,
    len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> Config {
        Config {
            arch: "llama".into(),
            n_layer: 1,
            n_head: 2,
            n_kv_head: 2,
            head_dim: 8,
            hidden: 16,
            ffn: 2,
            vocab: 2,
            ctx_train: 64,
            rope_base: 10_000.0,
            rope_dim: 8,
            rope_linear_scale: 1.0,
            rope_style: RopeStyle::Interleaved,
            rms_eps: 1e-5,
            sliding_window: None,
            rope_base_local: None,
            attn_scale: 0.125,
            block: crate::model::config::Block::of("llama").unwrap(),
        }
    }

    #[test]
    fn a_table_grown_late_gives_the_rotations_of_one_grown_early() {
        let x = Tensor::randn(0f32, 1.0, (1, 2, 3, 8), &Device::Cpu).unwrap();
        let rotate = |rope: &Rope, pos| -> Vec<f32> {
            let r = rope.apply(&x, pos).unwrap();
            r.flatten_all().unwrap().to_vec1().unwrap()
        };
        let mut c = cfg();
        c.ctx_train = 8192;
        let early = Rope::new(&c, 8192, None, DType::F32, &Device::Cpu).unwrap();
        let late = Rope::new(&c, 8192, None, DType::F32, &Device::Cpu).unwrap();
        let far = rotate(&early, 5000); // grows `early` to 8192 positions at once
        let near = rotate(&early, 7);
        assert_eq!(rotate(&late, 7), near); // `late` starts at 1024 positions
        assert_eq!(rotate(&late, 1500), rotate(&early, 1500)); // …then doubles
        assert_eq!(rotate(&late, 5000), far);
    }

    #[test]
    fn positions_past_the_table_rotate_as_a_longer_table_would() {
        let x = Tensor::randn(0f32, 1.0, (1, 2, 5, 8), &Device::Cpu).unwrap();
        let short = Rope::new(&cfg(), 16, None, DType::F32, &Device::Cpu).unwrap();
        let long = Rope::new(&cfg(), 64, None, DType::F32, &Device::Cpu).unwrap();
        for pos in [12, 16, 40] {
            let a = short.apply(&x, pos).unwrap().flatten_all().unwrap();
            let b = long.apply(&x, pos).unwrap().flatten_all().unwrap();
            let (a, b): (Vec<f32>, Vec<f32>) = (a.to_vec1().unwrap(), b.to_vec1().unwrap());
            assert_eq!(a, b, "position {pos}");
        }
    }
}
