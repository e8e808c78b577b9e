//! `kvchat kv-size`: the KV cache's memory arithmetic, from a model's metadata or explicit dimensions —
//! bytes per token, per context and per N concurrent users, for each storage mode and for a window,
//! and what grouped-query attention saves over full multi-head attention.

use crate::cli::KvSizeArgs;
use crate::kv::size::KvDims;
use crate::kv::Precision;
use anyhow::{bail, Result};

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
    pub modes: Vec<ModeRow>,
    /// (query heads, MHA bytes per token in `dtype`, saving factor)
    pub gqa: Option<(usize, f64, f64)>,
    /// A model whose layers declare sliding windows: (window, layers that declare it, bytes per
    /// user at `ctx` in `dtype` with those layers kept to their window, the same for a uniform cache).
    pub declared_windows: Option<DeclaredWindows>,
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

pub fn report(args: &KvSizeArgs) -> Result<KvSizeReport> {
    let (dims, model_heads, cfg) = match (args.layers, args.kv_heads, args.head_dim) {
        (Some(layers), Some(kv_heads), Some(head_dim)) => (
            KvDims {
                layers,
                kv_heads,
                head_dim,
            },
            None,
            None,
        ),
        _ => {
            let cfg = crate::model::files::config_of(&crate::source::resolve(
                args.model.as_deref(),
                args.models_file.as_deref(),
            )?)?;
            (KvDims::of(&cfg), Some(cfg.n_head), Some(cfg))
        }
    };
    if dims.layers == 0 || dims.kv_heads == 0 || dims.head_dim == 0 {
        bail!("--layers, --kv-heads and --head-dim must be at least 1");
    }
    if args.ctx == 0 || args.users == 0 {
        bail!("--ctx and --users must be at least 1");
    }
    let headline = args.dtype;
    let mut modes: Vec<ModeRow> = Precision::ALL
        .iter()
        .map(|&m| {
            let per_ctx = dims.bytes_for(m, args.ctx, args.residual);
            ModeRow {
                mode: m.name().to_string(),
                bytes_per_token: dims.bytes_per_token(m),
                bytes_per_context: per_ctx,
                bytes_all_users: per_ctx * args.users as f64,
            }
        })
        .collect();
    if let Some(w) = args.window {
        let held = args.ctx.min(w + args.sinks);
        let per_ctx = dims.bytes_for(headline, held, args.residual);
        modes.push(ModeRow {
            mode: format!("window:{w}+{} ({})", args.sinks, headline.name()),
            bytes_per_token: dims.bytes_per_token(headline),
            bytes_per_context: per_ctx,
            bytes_all_users: per_ctx * args.users as f64,
        });
    }
    let gqa = args.heads.or(model_heads).map(|h| {
        let mha = KvDims {
            kv_heads: h,
            ..dims
        }
        .bytes_per_token(headline);
        (h, mha, mha / dims.bytes_per_token(headline))
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
        };
        Some(DeclaredWindows {
            window: w,
            layers,
            bytes_per_context: KvDims::bytes_for_spec(&spec, cfg, args.ctx),
            uniform_bytes_per_context: dims.bytes_for_mode(&spec.mode, args.ctx),
        })
    });
    Ok(KvSizeReport {
        dims,
        ctx: args.ctx,
        users: args.users,
        dtype: headline.name().to_string(),
        modes,
        gqa,
        declared_windows,
    })
}

pub fn run(args: KvSizeArgs) -> Result<()> {
    let r = report(&args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
        return Ok(());
    }
    print!("{}", render(&r));
    Ok(())
}

pub fn render(r: &KvSizeReport) -> String {
    let d = r.dims;
    let mut s = format!(
        "KV cache of {} layers × {} KV heads × {} head dim, context {} tokens, {} user(s)\n",
        d.layers, d.kv_heads, d.head_dim, r.ctx, r.users
    );
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
    if let Some((h, mha, saving)) = r.gqa {
        s += &format!(
            "GQA: {} KV heads serve {h} query heads; full multi-head attention would hold {} bytes ({}) per token, {saving:.1}× more\n",
            d.kv_heads,
            grouped(mha),
            human(mha)
        );
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
    s += "int8/int4: one f16 scale per 32 values; per context includes the f16 copies of the last --residual positions\n";
    s
}
