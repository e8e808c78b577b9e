//! Rotary position embeddings: a cos/sin table computed once at load, applied to [b, heads, t, head_dim].

use super::config::{Config, RopeStyle};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor, D};

pub struct Rope {
    /// [max_positions, rope_dim / 2]
    cos: Tensor,
    /// [max_positions, rope_dim / 2]
    sin: Tensor,
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
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for p in 0..max_positions {
            let p = p as f32 / linear_scale;
            for f in inv_freq.iter() {
                let (s, c) = (p * f).sin_cos();
                cos.push(c);
                sin.push(s);
            }
        }
        let cos = Tensor::from_vec(cos, (max_positions, half), device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, (max_positions, half), device)?.to_dtype(dtype)?;
        Ok(Self {
            cos,
            sin,
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

    /// Rotates `x` [b, heads, t, head_dim] as if its t tokens sat at positions `pos .. pos + t`.
    /// Positions past the table (a window runs past the context) are computed the table's way.
    pub fn apply(&self, x: &Tensor, pos: usize) -> Result<Tensor> {
        let (_b, _h, t, d) = x.dims4()?;
        debug_assert_eq!(d, self.head_dim);
        let (cos, sin) = if pos + t <= self.max_positions {
            (self.cos.narrow(0, pos, t)?, self.sin.narrow(0, pos, t)?) // [t, rope_dim/2]
        } else {
            let (mut cos, mut sin) = (Vec::new(), Vec::new());
            for p in pos..pos + t {
                let p = p as f32 / self.linear_scale;
                for f in &self.inv_freq {
                    let (s, c) = (p * f).sin_cos();
                    cos.push(c);
                    sin.push(s);
                }
            }
            let shape = (t, self.inv_freq.len());
            let dev = self.cos.device();
            let dt = self.cos.dtype();
            (
                Tensor::from_vec(cos, shape, dev)?.to_dtype(dt)?,
                Tensor::from_vec(sin, shape, dev)?.to_dtype(dt)?,
            )
        };
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
