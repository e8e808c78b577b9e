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
    /// YaRN's blend of interpolated and extrapolated frequencies, when the model asks for it.
    yarn: Option<YarnMix>,
}

/// YaRN as ggml's `rope_yarn` computes it: frequency pair i turns at
/// θ = θ_interp·(1 − r_i) + θ_extrap·r_i, θ_interp = θ_extrap / factor, r_i a ramp falling from
/// 1 to 0 between the correction dimensions `low` and `high`; cos and sin times `mscale`.
#[derive(Debug, Clone, Copy)]
struct YarnMix {
    freq_scale: f32,
    low: f32,
    high: f32,
    mscale: f32,
}

impl YarnMix {
    fn new(y: &crate::model::config::Yarn, rope_dim: usize, base: f32) -> Self {
        // The dimension whose wavelength turns `turns` times over the original context
        // (ggml's `ggml_rope_yarn_corr_dim`).
        let dim = |turns: f32| {
            rope_dim as f32 * (y.orig_ctx as f32 / (turns * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * base.ln())
        };
        let freq_scale = 1.0 / y.factor;
        Self {
            freq_scale,
            low: dim(y.beta_fast).floor().max(0.0),
            high: dim(y.beta_slow).ceil().min(rope_dim as f32 - 1.0),
            mscale: 1.0 + 0.1 * (1.0 / freq_scale).ln(),
        }
    }

    /// cos and sin of pair `i` at angle `theta_extrap` (position × frequency).
    fn cos_sin(&self, i: usize, theta_extrap: f32) -> (f32, f32) {
        let y = (i as f32 - self.low) / (self.high - self.low).max(0.001);
        let mix = 1.0 - y.clamp(0.0, 1.0);
        let theta_interp = self.freq_scale * theta_extrap;
        let theta = theta_interp * (1.0 - mix) + theta_extrap * mix;
        let (s, c) = theta.sin_cos();
        (c * self.mscale, s * self.mscale)
    }
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
        let mut rope = Self::with_base(
            cfg,
            (cfg.rope_base, cfg.rope_linear_scale),
            max_positions,
            freq_factors,
            dtype,
            device,
        )?;
        rope.yarn = cfg
            .yarn
            .map(|y| YarnMix::new(&y, cfg.rope_dim, cfg.rope_base));
        Ok(rope)
    }

    /// The rotation of the model's sliding-window layers when they have a base of their own
    /// (`Config::rope_base_local`: no scaling, no frequency factors), over their own head size
    /// and rotated dimensions where those differ (Gemma 4); None when they do not.
    pub fn local(
        cfg: &Config,
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Self>> {
        let mut local = cfg.clone();
        if let Some(l) = &cfg.layers {
            (local.head_dim, local.rope_dim) = (l.head_dim_local, l.rope_dim_local);
        }
        cfg.rope_base_local
            .map(|base| Self::with_base(&local, (base, 1.0), max_positions, None, dtype, device))
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
            yarn: None,
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
            for (i, f) in self.inv_freq.iter().enumerate() {
                let (c, s) = match &self.yarn {
                    Some(y) => y.cos_sin(i, p * f),
                    None => {
                        let (s, c) = (p * f).sin_cos();
                        (c, s)
                    }
                };
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
        let mut cfg = crate::model::config::test_config(2, 8);
        cfg.ctx_train = 64;
        cfg
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

#[cfg(test)]
mod yarn_tests {
    use super::*;
    use crate::model::config::Yarn;

    /// gpt-oss's YaRN (factor 32 over 4,096 positions, base 150,000, 64 dimensions): pairs below
    /// the fast correction dimension (⌊8.09⌋ = 8) turn as unscaled, pairs from the slow one
    /// (⌈17.4⌉ = 18) at 1/32 of their speed, with cos and sin times 1 + 0.1·ln 32 (ggml's
    /// `rope_yarn`).
    #[test]
    fn yarn_extrapolates_fast_pairs_interpolates_slow_ones_and_scales_both() {
        let mut cfg = crate::kv::test_config(1, 64);
        cfg.rope_base = 150_000.0;
        cfg.yarn = Some(Yarn {
            factor: 32.0,
            orig_ctx: 4096,
            beta_fast: 32.0,
            beta_slow: 1.0,
        });
        let rope = Rope::new(&cfg, 1024, None, DType::F32, &Device::Cpu).unwrap();
        let y = rope.yarn.unwrap();
        assert_eq!((y.low, y.high), (8.0, 18.0));
        let (cos, sin) = rope.angles(300, 301).unwrap();
        let (cos, sin): (Vec<f32>, Vec<f32>) = (
            cos.flatten_all().unwrap().to_vec1().unwrap(),
            sin.flatten_all().unwrap().to_vec1().unwrap(),
        );
        let mscale = 1.0 + 0.1 * 32f32.ln();
        let freq = |i: usize| 1.0 / 150_000f32.powf(2.0 * i as f32 / 64.0);
        for i in [0, 5, 8] {
            let theta = 300.0 * freq(i);
            assert_eq!(cos[i], theta.cos() * mscale, "pair {i}");
            assert_eq!(sin[i], theta.sin() * mscale, "pair {i}");
        }
        for i in [18, 31] {
            let theta = (1.0 / 32.0) * (300.0 * freq(i));
            assert_eq!(cos[i], theta.cos() * mscale, "pair {i}");
        }
        // Between: a blend.
        let (ex, ip) = (300.0 * freq(13), 300.0 * freq(13) / 32.0);
        let mix = 1.0 - (13.0 - 8.0) / 10.0;
        assert!((cos[13] - (ip * (1.0 - mix) + ex * mix).cos() * mscale).abs() < 1e-6);
    }
}
