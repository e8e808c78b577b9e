//! The KV cache's memory arithmetic, from a model's metadata or given dimensions: bytes per
//! token, per context and per N concurrent users, for each precision and for a window, and what
//! grouped-query attention saves over full multi-head attention.

use crate::kv::size::KvDims;
use crate::kv::Precision;
use anyhow::{bail, Result};
use std::path::PathBuf;

#[derive(Debug, Clone, serde::Serialize)]
pub struct ModeRow {
    pub mode: String,
    pub bytes_per_token: f64,
    pub bytes_per_context: f64,
    pub bytes_all_users: f64,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct KvSizeReport {
    pub dims: KvDims,
    pub ctx: usize,
    pub users: usize,
    pub dtype: String,
    /// Recent positions a quantized cache also keeps in f16 (counted in its rows).
    pub residual: usize,
    pub modes: Vec<ModeRow>,
    /// (query heads, MHA bytes per token in `dtype`, saving factor)
    pub gqa: Option<(usize, f64, f64)>,
    /// A model whose layers declare sliding windows: (window, layers that declare it, bytes per
    /// user at `ctx` in `dtype` with those layers kept to their window, the same for a uniform cache).
    pub declared_windows: Option<DeclaredWindows>,
    /// A model whose layers differ in shape or share keys and values (Gemma 4): what each kind
    /// keeps, in words (the dims above are then its widest layer's).
    pub layer_kinds: Option<String>,
    /// A model with recurrent layers (Qwen3.5): what its two kinds of memory hold per user.
    pub recurrent: Option<crate::kv::size::MemoryByKind>,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct DeclaredWindows {
    pub window: usize,
    pub layers: usize,
    pub bytes_per_context: f64,
    pub uniform_bytes_per_context: f64,
}

/// 1536 → "1.50 KiB"; powers of 1024.
pub fn human(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

/// 327680 → "327,680".
pub fn grouped(n: f64) -> String {
    let s = format!("{:.0}", n);
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Where a size query's dimensions come from.
#[derive(Debug, Clone, PartialEq)]
pub enum DimsFrom {
    Given(KvDims),
    /// A model's metadata (a name, `hf:` reference or path; None: the default), through a registry.
    Model {
        model: Option<String>,
        models_file: Option<PathBuf>,
    },
}

/// What to size: a model's (or given) dimensions at a context, for some users.
#[derive(Debug, Clone, PartialEq)]
pub struct KvSizeQuery {
    pub dims: DimsFrom,
    /// Query heads, to show what GQA saves (default: the model's).
    pub heads: Option<usize>,
    /// The precision of the headline figures.
    pub precision: Precision,
    /// Context length in tokens (at least 1).
    pub ctx: usize,
    /// Concurrent sequences (at least 1).
    pub users: usize,
    /// Also a window of `(window, sinks)` positions.
    pub window: Option<(usize, usize)>,
    /// Also a budget of this many positions per layer (what it holds after each eviction).
    pub budget: Option<usize>,
    /// Recent positions a quantized cache also keeps in f16.
    pub residual: usize,
}

pub fn report(args: &KvSizeQuery) -> Result<KvSizeReport> {
    let (dims, model_heads, cfg) = match &args.dims {
        DimsFrom::Given(d) => (*d, None, None),
        DimsFrom::Model { model, models_file } => {
            let cfg = crate::model::files::config_of(&crate::source::resolve(
                model.as_deref(),
                models_file.as_deref(),
            )?)?;
            (KvDims::of(&cfg), Some(cfg.n_head), Some(cfg))
        }
    };
    if dims.layers == 0 || dims.kv_heads == 0 || dims.head_dim == 0 {
        bail!(
            "a KV cache of {} layers × {} KV heads × {} head dim holds nothing: each must be at least 1",
            dims.layers,
            dims.kv_heads,
            dims.head_dim
        );
    }
    if args.ctx == 0 || args.users == 0 {
        bail!("the context and the users must each be at least 1");
    }
    let headline = args.precision;
    // Bytes a token adds over the layers that keep keys and values, each of its own shape
    // (`KvDims::bytes_per_token` for a model whose layers are alike).
    let per_token = |p: Precision| match &cfg {
        Some(c) => KvDims::model_bytes_per_token(c, p),
        None => dims.bytes_per_token(p),
    };
    let bytes_for = |p: Precision, n: usize| {
        let resid = if p.quantized() {
            n.min(args.residual)
        } else {
            0
        };
        n as f64 * per_token(p) + resid as f64 * per_token(Precision::F16)
    };
    let mut modes: Vec<ModeRow> = Precision::ALL
        .iter()
        .map(|&m| {
            let per_ctx = bytes_for(m, args.ctx);
            ModeRow {
                mode: m.name().to_string(),
                bytes_per_token: per_token(m),
                bytes_per_context: per_ctx,
                bytes_all_users: per_ctx * args.users as f64,
            }
        })
        .collect();
    // A retention that holds at most `most` positions, at the headline precision.
    let bounded = |mode: String, most: usize| {
        let per_ctx = bytes_for(headline, args.ctx.min(most));
        ModeRow {
            mode,
            bytes_per_token: per_token(headline),
            bytes_per_context: per_ctx,
            bytes_all_users: per_ctx * args.users as f64,
        }
    };
    if let Some((w, sinks)) = args.window {
        modes.push(bounded(
            format!("window:{w}+{sinks} ({})", headline.name()),
            w + sinks,
        ));
    }
    if let Some(b) = args.budget {
        let mode = format!(
            "budget:{b} ({}; up to {} more between evictions)",
            headline.name(),
            crate::kv::SLACK
        );
        modes.push(bounded(mode, b));
    }
    let gqa = args.heads.or(model_heads).map(|h| {
        let mha = match &cfg {
            Some(c) => (0..c.kv_layers())
                .map(|i| {
                    KvDims {
                        kv_heads: h,
                        ..KvDims::kv_layer(c, i)
                    }
                    .bytes_per_token(headline)
                })
                .sum(),
            None => KvDims {
                kv_heads: h,
                ..dims
            }
            .bytes_per_token(headline),
        };
        (h, mha, mha / per_token(headline))
    });
    let declared_windows = cfg.as_ref().and_then(|cfg| {
        let (w, layers) = cfg.window_layers()?;
        let spec = crate::kv::CacheSpec {
            mode: crate::kv::CacheMode {
                precision: headline,
                residual: args.residual,
                ..crate::kv::CacheMode::default()
            },
            max_positions: args.ctx,
            grow_by: None,
        };
        // Every layer keeping every position of its own (shared layers too).
        let uniform = (0..cfg.n_layer)
            .map(|i| KvDims::block(cfg, i).bytes_for_mode(&spec.mode, args.ctx))
            .sum();
        Some(DeclaredWindows {
            window: w,
            layers,
            bytes_per_context: KvDims::bytes_for_spec(&spec, cfg, args.ctx),
            uniform_bytes_per_context: uniform,
        })
    });
    let layer_kinds = cfg.as_ref().filter(|c| c.layers.is_some()).map(layer_kinds);
    let recurrent = cfg.as_ref().and_then(|c| {
        crate::kv::size::MemoryByKind::predicted(c, headline, args.ctx, args.residual)
    });
    Ok(KvSizeReport {
        dims,
        ctx: args.ctx,
        users: args.users,
        dtype: headline.name().to_string(),
        residual: args.residual,
        modes,
        gqa,
        declared_windows,
        layer_kinds,
        recurrent,
    })
}

/// What each kind of layer of a model whose layers differ keeps, in words: "4 of 6 layers keep
/// keys and values: 2 window layers of 2 KV heads × 32, 2 global of 1 × 64; layers 4–5 keep
/// none, reading those of layers 2 and 3".
pub fn layer_kinds(cfg: &crate::model::Config) -> String {
    let own = cfg.kv_layers();
    let map = cfg.layer_map();
    let kind = |window: bool| {
        let layers: Vec<usize> = (0..own)
            .filter(|&c| cfg.layer_window(map.kv_block(c)).is_some() == window)
            .collect();
        let mut shapes: Vec<(usize, usize)> = layers.iter().map(|&c| cfg.kv_shape(c)).collect();
        shapes.dedup();
        let shapes: Vec<String> = shapes.iter().map(|(k, d)| format!("{k} × {d}")).collect();
        (layers.len(), shapes.join(" or "))
    };
    let ((nw, sw), (ng, sg)) = (kind(true), kind(false));
    let mut s = format!(
        "{own} of {} layers keep keys and values: {nw} window layers of (KV heads × head dim) {sw}, {ng} global of {sg}",
        cfg.n_layer
    );
    if own < cfg.n_layer {
        let mut sources: Vec<usize> = (0..cfg.n_layer)
            .filter_map(|i| match map.block(i) {
                crate::model::layers::BlockMemory::Kv { kv, own: false } => Some(map.kv_block(kv)),
                _ => None,
            })
            .collect();
        sources.sort();
        sources.dedup();
        let sources: Vec<String> = sources.iter().map(|s| s.to_string()).collect();
        s += &format!(
            "; layers {own}–{} keep none, reading those of layers {}",
            cfg.n_layer - 1,
            sources.join(" and ")
        );
    }
    s
}

pub fn render(r: &KvSizeReport) -> String {
    let d = r.dims;
    let mut s = match &r.layer_kinds {
        Some(_) => format!(
            "KV cache of {} layers of different shapes (by kind below), context {} tokens, {} user(s)\n",
            d.layers, r.ctx, r.users
        ),
        None => format!(
            "KV cache of {} layers × {} KV heads × {} head dim, context {} tokens, {} user(s)\n",
            d.layers, d.kv_heads, d.head_dim, r.ctx, r.users
        ),
    };
    let head = r
        .modes
        .iter()
        .find(|m| m.mode == r.dtype)
        .expect("headline mode is in the table");
    s += &format!(
        "{}: {} bytes ({}) per token, {} per user at {} tokens, {} for {} user(s)\n",
        r.dtype,
        grouped(head.bytes_per_token),
        human(head.bytes_per_token),
        human(head.bytes_per_context),
        r.ctx,
        human(head.bytes_all_users),
        r.users
    );
    if let Some(k) = &r.layer_kinds {
        s += &format!("layers by kind: {k}\n");
    }
    if let Some((h, mha, saving)) = r.gqa {
        let kv = match r.layer_kinds {
            Some(_) => "fewer".to_string(),
            None => d.kv_heads.to_string(),
        };
        s += &format!(
            "GQA: {kv} KV heads serve {h} query heads; full multi-head attention would hold {} bytes ({}) per token, {saving:.1}× more\n",
            grouped(mha),
            human(mha)
        );
    }
    if let Some(m) = &r.recurrent {
        s += &format!("memory by kind per user at {} tokens: {m}\n", r.ctx);
    }
    if let Some(w) = &r.declared_windows {
        s += &format!(
            "sliding-window layers: {} of {} attend within {} positions (and keep {}): {} per user at {} tokens against {} for a uniform cache ({:.2}×)\n",
            w.layers,
            d.layers,
            w.window,
            w.window + crate::kv::DECLARED_WINDOW_SPARE,
            human(w.bytes_per_context),
            r.ctx,
            human(w.uniform_bytes_per_context),
            w.bytes_per_context / w.uniform_bytes_per_context
        );
    }
    s += &format!(
        "\n{:<22} {:>16} {:>14} {:>14}\n",
        "mode", "bytes/token", "per context", "all users"
    );
    for m in &r.modes {
        s += &format!(
            "{:<22} {:>16} {:>14} {:>14}\n",
            m.mode,
            grouped(m.bytes_per_token),
            human(m.bytes_per_context),
            human(m.bytes_all_users)
        );
    }
    s += &format!(
        "int8/int4: one f16 scale per 32 values; per context includes the f16 copies of the last {} positions\n",
        r.residual
    );
    s
}
