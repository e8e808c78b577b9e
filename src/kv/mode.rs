//! A cache's configuration as a person names it (`CacheMode`: precision, retention, placement,
//! joined by `+`), parsed and printed in one place, and a KV budget's limits.

use super::*;

/// A cache configuration as a person names it, before the context size is known: its parts
/// joined by `+`, in any order — a retention (`full`, default; `none`; `window:N`, optionally
/// followed by a sink count), a precision (`f32`, `f16` default, `bf16`, `int8`, `int4`; the
/// quantized ones take `:R`, the recent positions also kept in f16) and a placement (`offload`).
/// `full`, `window:256+4+int8`, `int4+offload`, `none+f32`. This is the one place such a name is
/// parsed; [`CacheMode::spec`] checks it against a context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheMode {
    pub precision: Precision,
    pub retention: Retention,
    pub offload: bool,
    /// Recent positions a quantized cache also keeps in f16.
    pub residual: usize,
    /// A budget given in bytes (`--kv-budget 64MiB`), not yet turned into positions: what
    /// [`CacheMode::for_model`] does, before [`CacheMode::spec`].
    pub budget_bytes: Option<u64>,
}

impl CacheMode {
    /// This mode for a model of `cfg`: a budget given in bytes becomes the positions whose rows
    /// take that many bytes over all layers (`KvDims::bytes_per_token` at the mode's precision;
    /// a quantized cache's f16 residual is on top).
    pub fn for_model(&self, cfg: &Config) -> Result<CacheMode> {
        let Some(bytes) = self.budget_bytes else {
            return Ok(*self);
        };
        let Retention::Budget {
            sinks,
            evict,
            pyramid,
            ..
        } = self.retention
        else {
            anyhow::bail!("a budget in bytes needs a budget retention");
        };
        let per = size::KvDims::model_bytes_per_token(cfg, self.precision);
        let budget = (bytes as f64 / per).floor() as usize;
        if let Some(why) = budget_unfit(budget, sinks, self.newest_kept()) {
            anyhow::bail!(
                "a budget of {} holds {budget} positions of this model ({} each in {}): {why}",
                crate::source::human_bytes(bytes),
                crate::source::human_bytes(per as u64),
                self.precision.name()
            );
        }
        Ok(CacheMode {
            retention: Retention::Budget {
                budget,
                sinks,
                evict,
                pyramid,
            },
            budget_bytes: None,
            ..*self
        })
    }
    /// Whether drafts can be verified exactly on this cache: every cache that keeps positions
    /// (batched where [`CacheMode::verifies_batched`], else row by row with the guesses taken back
    /// through `kv/layer/undo.rs`); not `none`.
    pub fn verifies_drafts(&self) -> bool {
        self.retention != Retention::None
    }

    /// Whether a verification step may attend its rows together: every position kept, in a float
    /// precision, so a batched step gives each row the bits of its single step and taking rows
    /// back is a truncation. Other caches attend a verification's rows apart
    /// (`DecoderCache::rows_apart`: a quantized cache reads a batched step's last positions from
    /// their f16 copies, a window's step sees the window as it was before the step, a budget
    /// evicts by what the step's queries attend) and take guesses back through a record of what
    /// each changed (`kv/layer/undo.rs`).
    pub fn verifies_batched(&self) -> bool {
        self.retention == Retention::All && !self.precision.quantized()
    }
}

impl CacheMode {
    /// The newest positions a budget of this mode always keeps ([`newest_kept`]).
    pub fn newest_kept(&self) -> usize {
        newest_kept(self.precision, self.residual)
    }

    /// Whether the sequence may not outgrow the context (a window or a budget holds a bounded
    /// number of positions however long the sequence runs).
    pub fn bounded_by_context(&self) -> bool {
        !matches!(
            self.retention,
            Retention::Window { .. } | Retention::Budget { .. }
        )
    }
}

impl Default for CacheMode {
    fn default() -> Self {
        Self {
            precision: DEFAULT_PRECISION,
            retention: Retention::All,
            offload: false,
            residual: DEFAULT_RESIDUAL,
            budget_bytes: None,
        }
    }
}

impl std::str::FromStr for CacheMode {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let num = |what: &str, v: &str| -> Result<usize> {
            v.parse()
                .map_err(|_| anyhow::anyhow!("cache mode '{s}': '{v}' is not a {what}"))
        };
        let mut mode = CacheMode::default();
        let (mut retention, mut precision, mut offload) = (None, None, false);
        let parts: Vec<&str> = s.split('+').collect();
        let mut i = 0;
        while i < parts.len() {
            let part = parts[i];
            let (name, arg) = match part.split_once(':') {
                Some((n, a)) => (n, Some(a)),
                None => (part, None),
            };
            let set_retention = |r: &mut Option<Retention>, new: Retention| -> Result<()> {
                if r.replace(new).is_some() {
                    anyhow::bail!("cache mode '{s}' names two retentions (choose one of full, none, window:N, budget:N)");
                }
                Ok(())
            };
            match (name, arg) {
                ("full", None) => set_retention(&mut retention, Retention::All)?,
                ("none", None) => set_retention(&mut retention, Retention::None)?,
                ("window", Some(w)) => {
                    let window = num("window size", w)?;
                    // A number right after the window is its sink count.
                    let (sinks, given) = match parts.get(i + 1) {
                        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                            i += 1;
                            (num("sink count", n)?, "")
                        }
                        _ => (DEFAULT_SINKS, " (the default)"),
                    };
                    if window == 0 {
                        anyhow::bail!("cache mode '{s}': a window must hold at least 1 position");
                    }
                    if sinks >= window {
                        anyhow::bail!(
                            "cache mode '{s}': {sinks} sinks{given} do not fit a window of {window} (give fewer: window:{window}+0)"
                        );
                    }
                    set_retention(&mut retention, Retention::Window { window, sinks })?
                }
                ("budget", Some(arg)) => {
                    let mut fields = arg.split(':');
                    let budget = num("budget", fields.next().unwrap_or(""))?;
                    let (mut evict, mut pyramid) = (Evict::DEFAULT, false);
                    for f in fields {
                        match f {
                            "pyramid" => pyramid = true,
                            "flat" => pyramid = false,
                            name => {
                                evict = Evict::parse(name).ok_or_else(|| {
                                    anyhow::anyhow!(
                                        "cache mode '{s}': unknown eviction policy '{name}' ({}, and flat or pyramid)",
                                        Evict::ALL.map(Evict::name).join(", ")
                                    )
                                })?
                            }
                        }
                    }
                    let sinks = match parts.get(i + 1) {
                        Some(n) if !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()) => {
                            i += 1;
                            num("sink count", n)?
                        }
                        _ => DEFAULT_SINKS,
                    };
                    let r = Retention::Budget {
                        budget,
                        sinks,
                        evict,
                        pyramid,
                    };
                    set_retention(&mut retention, r)?
                }
                ("offload", None) => {
                    if std::mem::replace(&mut offload, true) {
                        anyhow::bail!("cache mode '{s}' names offload twice");
                    }
                }
                (p, arg) if Precision::parse(p).is_some() => {
                    let p = Precision::parse(p).expect("checked");
                    if let Some(r) = arg {
                        if !p.quantized() {
                            anyhow::bail!("cache mode '{s}': only int8 and int4 take a residual (':{r}')");
                        }
                        mode.residual = num("residual position count", r)?;
                    }
                    if precision.replace(p).is_some() {
                        anyhow::bail!("cache mode '{s}' names two precisions");
                    }
                }
                _ => anyhow::bail!(
                    "cache mode '{s}': unknown part '{part}' (full, none, window:N[+S], budget:N[:POLICY][:pyramid][+S], f32, f16, bf16, int8[:R], int4[:R], offload)"
                ),
            }
            i += 1;
        }
        mode.retention = retention.unwrap_or(Retention::All);
        mode.precision = precision.unwrap_or(DEFAULT_PRECISION);
        if let Retention::Budget { budget, sinks, .. } = mode.retention {
            if let Some(why) = budget_unfit(budget, sinks, mode.newest_kept()) {
                anyhow::bail!("cache mode '{s}': {why}");
            }
        }
        mode.offload = offload;
        if mode.retention == Retention::None && offload {
            anyhow::bail!(
                "cache mode '{s}': nothing is kept with none, so there is nothing to offload"
            );
        }
        Ok(mode)
    }
}

impl std::fmt::Display for CacheMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.retention {
            Retention::None => write!(f, "none")?,
            Retention::All => write!(f, "full")?,
            Retention::Window { window, sinks } => write!(f, "window:{window}+{sinks}")?,
            Retention::Budget {
                budget,
                sinks,
                evict,
                pyramid,
            } => {
                match self.budget_bytes {
                    Some(b) => write!(f, "budget:{}", crate::source::human_bytes(b))?,
                    None => write!(f, "budget:{budget}")?,
                }
                write!(f, ":{}", evict.name())?;
                if pyramid {
                    write!(f, ":pyramid")?;
                }
                write!(f, "+{sinks}")?;
            }
        }
        if self.precision != DEFAULT_PRECISION {
            write!(f, "+{}", self.precision.name())?;
            if self.precision.quantized() && self.residual != DEFAULT_RESIDUAL {
                write!(f, ":{}", self.residual)?;
            }
        }
        if self.offload {
            write!(f, "+offload")?;
        }
        Ok(())
    }
}

impl CacheMode {
    /// The configuration for a context of `ctx` positions; impossible settings are refused here,
    /// in words that name the values.
    pub fn spec(&self, ctx: usize) -> Result<CacheSpec> {
        if let Some(bytes) = self.budget_bytes {
            anyhow::bail!(
                "a budget of {bytes} bytes must be turned into positions for the model first (CacheMode::for_model)"
            );
        }
        if let Retention::Window { window, sinks } = self.retention {
            if window == 0 {
                anyhow::bail!("a window must hold at least 1 position");
            }
            if sinks >= window {
                anyhow::bail!(
                    "{sinks} sinks do not fit a window of {window} (fewer sinks than positions)"
                );
            }
            // What a window holds must fit the memory the context was sized (and checked) for.
            if window.saturating_add(sinks) > ctx {
                return Err(crate::fixable(
                    crate::Fix::WindowOverContext,
                    format!(
                        "a window of {window} with {sinks} sinks holds more than the context of {ctx} positions"
                    ),
                ));
            }
        }
        if let Retention::Budget { budget, sinks, .. } = self.retention {
            if let Some(why) = budget_unfit(budget, sinks, self.newest_kept()) {
                anyhow::bail!(why);
            }
            if budget > ctx {
                return Err(crate::fixable(
                    crate::Fix::BudgetOverContext,
                    format!("a budget of {budget} positions is larger than the context of {ctx}"),
                ));
            }
        }
        Ok(CacheSpec {
            mode: *self,
            max_positions: ctx,
            grow_by: None,
        })
    }
}

/// Why a budget of `budget` positions with `sinks` sinks cannot work, if it cannot: it must
/// hold the sinks, the `newest` positions that always stay ([`newest_kept`]) and at least
/// [`OBSERVE_WINDOW`] more chosen by score.
pub fn budget_unfit(budget: usize, sinks: usize, newest: usize) -> Option<String> {
    let least = budget_least(sinks, newest);
    (budget < least).then(|| {
        format!(
            "a budget of {budget} positions is too small: it keeps {sinks} sinks and the newest {newest} positions, and needs {OBSERVE_WINDOW} more to choose by score ({least} at least)"
        )
    })
}

/// The fewest positions a budget works with (see [`budget_unfit`]).
pub fn budget_least(sinks: usize, newest: usize) -> usize {
    sinks + newest + OBSERVE_WINDOW
}
