//! What a run will take in memory, worked out from the model's metadata before any weight loads:
//! the weights, the KV cache at the most positions the context lets a sequence reach, the RoPE
//! table and any recurrent state. Against a limit — one the user gave, else the memory the
//! system has available — the run fits, is refused in one line naming what would fit, or, when
//! the user asked for it (`fit`), takes the first of a narrower KV precision and a shorter
//! context that fits, and says so.

use crate::kv::size::KvDims;
use crate::kv::{Precision, DEFAULT_PRECISION, DEFAULT_RESIDUAL};
use crate::model::Config;
use crate::{fixable, human_bytes, Fix};
use anyhow::{bail, Result};

/// The shortest context `fit` lowers to: a chat turn or two.
const MIN_FIT_CTX: usize = 256;

/// Bytes a run takes, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// The weights as stored (the model's files).
    pub weights: u64,
    /// Keys and values of every layer that keeps them, at `ctx` positions in `precision`.
    pub kv: u64,
    /// The RoPE table, one row per position.
    pub rope: u64,
    /// Recurrent layers' states with the snapshots a cache keeps (Qwen3.5).
    pub state: u64,
    pub ctx: usize,
    pub precision: Precision,
}

impl Need {
    /// What a model of `cfg`, its weights `weights` bytes, takes at `ctx` positions of KV in `p`.
    pub fn of(cfg: &Config, weights: u64, p: Precision, ctx: usize) -> Self {
        Self {
            weights,
            kv: KvDims::model_bytes_for(cfg, p, ctx, DEFAULT_RESIDUAL) as u64,
            rope: (ctx as u64).saturating_mul(cfg.rope_dim as u64 * 4),
            state: KvDims::state_bytes(cfg) as u64,
            ctx,
            precision: p,
        }
    }

    pub fn total(&self) -> u64 {
        self.weights
            .saturating_add(self.kv)
            .saturating_add(self.rope)
            .saturating_add(self.state)
    }

    /// The part that grows with the context: what the system-memory rule bounds.
    fn per_context(&self) -> u64 {
        self.kv.saturating_add(self.rope)
    }
}

impl std::fmt::Display for Need {
    /// "853.2 MiB: weights 468.6 MiB, KV cache 384.0 MiB (f16 at 32768 tokens), RoPE table 8.0 MiB".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: weights {}, KV cache {} ({} at {} tokens), RoPE table {}",
            human_bytes(self.total()),
            human_bytes(self.weights),
            human_bytes(self.kv),
            self.precision.name(),
            self.ctx,
            human_bytes(self.rope)
        )?;
        if self.state > 0 {
            write!(f, ", recurrent state {}", human_bytes(self.state))?;
        }
        Ok(())
    }
}

/// What a run must fit in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// A limit the user gave: everything the run takes must fit in it.
    Given(u64),
    /// Nothing given: the KV cache and RoPE table must fit in this share of the memory the system
    /// has available (`available_memory`: half of it, the rest left for the weights and all else).
    Available(u64),
}

impl Limit {
    fn fits(&self, need: &Need) -> bool {
        match *self {
            Limit::Given(m) => need.total() <= m,
            Limit::Available(a) => need.per_context() <= a,
        }
    }

    fn describe(&self) -> String {
        match *self {
            Limit::Given(m) => format!("the memory limit of {}", human_bytes(m)),
            Limit::Available(a) => format!("the {} of memory available", human_bytes(a)),
        }
    }
}

/// The plan a run loads with.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub need: Need,
    /// The KV precision `fit` chose instead of the one asked for.
    pub precision: Option<Precision>,
}

/// Works out what the run takes and decides: the context (and with `fit`, the KV precision) it
/// loads with, or a one-line refusal that names what would fit.
///
/// `asked` is the widest KV precision the run uses; `ctx` the context asked for (None: the
/// model's trained one, lowered to what fits with a note when no limit was given); `fit` lets the
/// plan narrow the KV precision, when it is the default one, and shorten the context until the
/// run fits.
pub fn plan(
    cfg: &Config,
    weights: u64,
    asked: Precision,
    ctx: Option<usize>,
    limit: Limit,
    fit: bool,
) -> Result<Plan> {
    let want = match ctx {
        Some(0) => bail!("a context of 0 tokens holds nothing"),
        Some(c) => c,
        None if cfg.ctx_train == 0 => bail!("the model declares a context length of 0"),
        None => cfg.ctx_train,
    };
    let need = |p, c| Need::of(cfg, weights, p, c);
    let asked_need = need(asked, want);
    if limit.fits(&asked_need) {
        return Ok(Plan {
            need: asked_need,
            precision: None,
        });
    }
    if let Limit::Given(m) = limit {
        if weights > m {
            bail!(
                "the weights alone take {}, more than the memory limit of {}",
                human_bytes(weights),
                human_bytes(m)
            );
        }
    }
    // Narrower precisions first (they keep every position), then shorter contexts at the
    // narrowest one tried.
    let narrower: Vec<Precision> = [Precision::Int8, Precision::Int4]
        .into_iter()
        .filter(|_| asked == DEFAULT_PRECISION)
        .filter(|p| cfg.kv_shapes().all(|(_, hd)| p.unfit(hd).is_none()))
        .collect();
    let by_precision = narrower
        .iter()
        .map(|&p| need(p, want))
        .find(|n| limit.fits(n));
    let shorter = |p: Precision| {
        let mut c = want;
        while c > MIN_FIT_CTX {
            c = (c / 2).max(MIN_FIT_CTX);
            if limit.fits(&need(p, c)) {
                return Some(need(p, c));
            }
        }
        None
    };
    match (fit, ctx, limit) {
        (true, _, _) => {
            let chosen =
                by_precision.or_else(|| shorter(narrower.last().copied().unwrap_or(asked)));
            let Some(n) = chosen else {
                bail!(
                    "no KV precision or context of at least {MIN_FIT_CTX} tokens fits {}: the run needs {asked_need}",
                    limit.describe()
                );
            };
            crate::notes::note(format!(
                "fit: KV cache in {} at a context of {} tokens; the run takes {n}, within {}",
                n.precision.name(),
                n.ctx,
                limit.describe()
            ));
            Ok(Plan {
                precision: (n.precision != asked).then_some(n.precision),
                need: n,
            })
        }
        (false, None, Limit::Available(a)) => {
            // The trained context, lowered to a power of two that fits, as before any limit.
            let per_token = asked_need.per_context() / want.max(1) as u64;
            let mut c = (a / per_token.max(1)) as usize;
            c = 1usize << (usize::BITS - 1 - c.max(2).leading_zeros());
            crate::notes::note(format!(
                "note: the model's context of {want} tokens would need {} of KV cache; using a context of {c}",
                human_bytes(asked_need.kv)
            ));
            Ok(Plan {
                need: need(asked, c),
                precision: None,
            })
        }
        (false, _, _) => {
            let mut would = Vec::new();
            if let Some(n) = by_precision {
                would.push(format!(
                    "KV cache in {} ({})",
                    n.precision.name(),
                    human_bytes(n.total())
                ));
            }
            if let Some(n) = shorter(asked) {
                would.push(format!(
                    "a context of {} tokens ({})",
                    n.ctx,
                    human_bytes(n.total())
                ));
            }
            let fix = match limit {
                Limit::Given(_) => Fix::FitMemory,
                Limit::Available(_) => Fix::LowerContext,
            };
            let fits_with = match would.is_empty() {
                true => String::new(),
                false => format!("; it fits with {}", would.join(" or ")),
            };
            Err(fixable(
                fix,
                format!(
                    "a context of {want} tokens needs {asked_need}, more than {}{fits_with}",
                    limit.describe()
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Qwen2.5-0.5B's shape, as its GGUF states it: 24 layers, 14 heads (2 KV) of 64, 32k trained.
    fn qwen05() -> Config {
        use candle_core::quantized::gguf_file::{Content, Value as V, VersionedMagic};
        let md = [
            ("general.architecture", V::String("qwen2".into())),
            ("qwen2.block_count", V::U32(24)),
            ("qwen2.context_length", V::U32(32768)),
            ("qwen2.embedding_length", V::U32(896)),
            ("qwen2.feed_forward_length", V::U32(4864)),
            ("qwen2.attention.head_count", V::U32(14)),
            ("qwen2.attention.head_count_kv", V::U32(2)),
            ("qwen2.attention.layer_norm_rms_epsilon", V::F32(1e-6)),
            ("qwen2.rope.freq_base", V::F32(1e6)),
            ("qwen2.vocab_size", V::U32(151936)),
        ];
        Config::from_gguf(&Content {
            magic: VersionedMagic::GgufV3,
            metadata: md.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        })
        .unwrap()
    }

    const WEIGHTS: u64 = 491_400_064;
    const MIB: u64 = 1 << 20;

    #[test]
    fn the_kv_cache_of_qwen_05b_at_32k_in_f16_is_384_mib() {
        let n = Need::of(&qwen05(), WEIGHTS, Precision::F16, 32768);
        assert_eq!(n.kv, 384 * MIB);
        assert_eq!(n.rope, 8 * MIB);
        assert_eq!(n.total(), WEIGHTS + 392 * MIB);
    }

    #[test]
    fn a_run_that_fits_its_limit_keeps_what_it_asked_for() {
        let p = plan(
            &qwen05(),
            WEIGHTS,
            Precision::F16,
            Some(32768),
            Limit::Given(2048 * MIB),
            false,
        )
        .unwrap();
        assert_eq!((p.need.ctx, p.precision), (32768, None));
    }

    #[test]
    fn a_run_over_its_limit_is_refused_naming_what_would_fit() {
        let e = plan(
            &qwen05(),
            WEIGHTS,
            Precision::F16,
            Some(32768),
            Limit::Given(768 * MIB),
            false,
        )
        .unwrap_err();
        let f = e.downcast_ref::<crate::Fixable>().unwrap();
        assert_eq!(f.fix, Fix::FitMemory);
        assert!(
            f.message
                .contains("more than the memory limit of 768.00 MiB"),
            "{}",
            f.message
        );
        assert!(
            f.message.contains("it fits with KV cache in int8"),
            "{}",
            f.message
        );
        assert!(
            f.message.contains("or a context of 16384 tokens"),
            "{}",
            f.message
        );
    }

    #[test]
    fn fit_narrows_the_kv_precision_before_it_shortens_the_context() {
        let p = plan(
            &qwen05(),
            WEIGHTS,
            Precision::F16,
            Some(32768),
            Limit::Given(768 * MIB),
            true,
        )
        .unwrap();
        assert_eq!((p.need.ctx, p.precision), (32768, Some(Precision::Int8)));
        assert!(p.need.total() <= 768 * MIB);
    }

    #[test]
    fn fit_keeps_a_precision_other_than_the_default_and_shortens_the_context() {
        let p = plan(
            &qwen05(),
            WEIGHTS,
            Precision::F32,
            Some(32768),
            Limit::Given(768 * MIB),
            true,
        )
        .unwrap();
        assert_eq!((p.need.ctx, p.precision), (8192, None));
    }

    #[test]
    fn fit_under_the_weights_alone_is_refused_naming_their_size() {
        let e = plan(
            &qwen05(),
            WEIGHTS,
            Precision::F16,
            None,
            Limit::Given(256 * MIB),
            true,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "the weights alone take 468.64 MiB, more than the memory limit of 256.00 MiB"
        );
    }

    #[test]
    fn without_a_limit_the_trained_context_is_lowered_to_what_memory_holds() {
        let p = plan(
            &qwen05(),
            WEIGHTS,
            Precision::F16,
            None,
            Limit::Available(100 * MIB),
            false,
        )
        .unwrap();
        assert_eq!((p.need.ctx, p.precision), (8192, None));
    }
}
