//! Scaled dot-product attention with a causal mask, for one sequence, grouped-query.
//!
//! On CPU a fused kernel does every query row on its own, in the same order whatever the step's
//! length: a prefill, a token-by-token decode and a `--no-cache` recompute give bit-identical
//! results, and no `[rows, L]` score tensor or K/V copy is ever made. It reads the cache's rows in
//! their stored format, each widened to f32 in a row of scratch by its format's decoder
//! (`kvrows`), so f16, bf16, INT8 and INT4 caches are read in place. Other devices use candle ops.
//!
//! Shapes: each query tensor `[nkv, g*t, hd]` (the g query heads sharing a KV head, each with t
//! rows); the view's parts hold L positions per KV head; the step's t queries sit at the last t of
//! the L positions. Result `[nkv, g*t, hd]`.
//!
//! Files: `ops` (candle ops: the device path, the mask, Hadamard), `chunk` (the work split and the
//! combination of partials), `tile` (the fused kernel's loops).

mod chunk;
mod ops;
#[cfg(test)]
mod tests;
mod tile;

use chunk::*;
use ops::*;
pub use ops::{attend_candle_ops, causal_mask, hadamard_product, hadamard_rows};
pub(crate) use tile::exp_nonpositive;
use tile::*;

use super::disjoint::DisjointOut;
use super::kvrows::{self, Codec};
use crate::model::cache::{with_host_rows, KvView, Rows};
use anyhow::{bail, ensure, Result};
use candle_core::Tensor;

/// Attention of the queries over a layer's view. `qs[0]` is rotated at the step's position, `qs[1]`
/// (when a part asks for it) where a window's sinks need it.
pub fn attend_view(qs: &[&Tensor], view: &KvView<'_>, t: usize, scale: f32) -> Result<Tensor> {
    Ok(attend_view_observed(qs, view, t, scale, None, 0)?.0)
}

/// [`attend_view`], and the attention the step's last `observe` queries pay each key: their
/// softmax weights summed over those queries and the g query heads of each KV head, `[nkv, L]`
/// (empty when `observe` is 0). What a cache that evicts by score (`Retention::Budget`) ranks
/// positions by; the weights are the ones the softmax computes anyway, not a second pass.
/// `sinks` (gpt-oss): one logit per query head that joins each of its rows' softmax, with no
/// value, so a row may attend to nothing (the observed weights are then those with the sink).
pub fn attend_view_observed(
    qs: &[&Tensor],
    view: &KvView<'_>,
    t: usize,
    scale: f32,
    sinks: Option<&[f32]>,
    observe: usize,
) -> Result<(Tensor, Vec<f32>)> {
    check_queries(qs, view, t, observe, sinks)?;
    if on_host(qs, view) {
        return attend_host_at(qs, view, t, scale, sinks, observe, false);
    }
    // Device: scores per part with its queries, then one softmax over them all. Rows stored
    // Hadamard-rotated (quantized caches) meet rotated queries, and the output is rotated back:
    // (Hq)·(Hk) = q·k, Σ p·(Hv) = H(Σ p·v).
    let rotated: Vec<Tensor> = match view.hadamard {
        Some(b) => qs
            .iter()
            .map(|q| hadamard_rows(q, b))
            .collect::<Result<_>>()?,
        None => qs.iter().map(|q| (*q).clone()).collect(),
    };
    let mut scores = Vec::with_capacity(view.parts.len());
    let mut values = Vec::with_capacity(view.parts.len());
    for p in &view.parts {
        let Rows::Dense { k, v } = &p.rows else {
            bail!("a KV view mixes host and device rows");
        };
        let q = &rotated[p.query.index()];
        let k = k.squeeze(0)?.to_dtype(q.dtype())?; // [nkv, len, hd]
        scores.push(q.matmul(&k.t()?)?); // [nkv, g*t, len]
        values.push(v.squeeze(0)?.to_dtype(q.dtype())?);
    }
    let scores = Tensor::cat(&scores, 2)?;
    let values = Tensor::cat(&values, 1)?.contiguous()?;
    let probs = softmax_probs(scores, t, scale, view.window, sinks)?; // [nkv, g*t, L]
    let observed = if observe > 0 {
        let (nkv, gt, l) = probs.dims3()?;
        probs
            .reshape((nkv, gt / t, t, l))?
            .narrow(2, t - observe, observe)?
            .sum((1, 2))? // [nkv, L]
            .flatten_all()?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?
    } else {
        Vec::new()
    };
    let out = probs.matmul(&values)?; // [nkv, g*t, hd]
    let out = match view.hadamard {
        Some(b) => hadamard_rows(&out, b)?,
        None => out,
    };
    Ok((out, observed))
}

/// Whether the fused CPU kernel runs this attention: queries on the CPU, every part's rows
/// host rows.
fn on_host(qs: &[&Tensor], view: &KvView<'_>) -> bool {
    qs.first().is_some_and(|q| q.device().is_cpu())
        && view
            .parts
            .iter()
            .all(|p| !matches!(p.rows, Rows::Dense { .. }))
}

/// The queries, the view's rotations, the observed rows and the sinks agree.
fn check_queries(
    qs: &[&Tensor],
    view: &KvView<'_>,
    t: usize,
    observe: usize,
    sinks: Option<&[f32]>,
) -> Result<()> {
    ensure!(!qs.is_empty(), "attention needs queries");
    ensure!(
        observe <= t,
        "attention: {observe} observed queries of a step of {t}"
    );
    if let Some(p) = view.parts.iter().find(|p| p.query.index() >= qs.len()) {
        bail!(
            "a part of the KV view pairs with query rotation {:?} that was not given",
            p.query
        );
    }
    if let Some(s) = sinks {
        let (nkv, gt, _) = qs[0].dims3()?;
        ensure!(
            t > 0 && gt % t == 0 && s.len() == nkv * (gt / t),
            "attention: {} sink logits for {} query heads",
            s.len(),
            nkv * (gt / t.max(1))
        );
    }
    Ok(())
}

/// The fused CPU kernel over host rows, with the observed queries' weights as
/// [`attend_view_observed`] gives them; its tile loops built portably where `portable` (the
/// reference the SIMD build is tested against) or as this CPU runs them best.
fn attend_host_at(
    qs: &[&Tensor],
    view: &KvView<'_>,
    t: usize,
    scale: f32,
    sinks: Option<&[f32]>,
    observe: usize,
    portable: bool,
) -> Result<(Tensor, Vec<f32>)> {
    let one = SeqQuery { qs, view, observe };
    let mut outs = attend_host_many(std::slice::from_ref(&one), t, scale, sinks, portable)?;
    Ok(outs.pop().expect("one attention"))
}

/// One sequence's attention in a batched step (`StepCache::PerRow`): its query rotations and
/// view, as [`attend_view_observed`] takes them, and how many of its last queries' weights its
/// cache wants back.
pub struct SeqQuery<'q, 'v> {
    pub qs: &'q [&'q Tensor],
    pub view: &'q KvView<'v>,
    pub observe: usize,
}

/// [`attend_view_observed`] for each of several sequences that share a layer (the same `t`,
/// `scale` and sinks): on the CPU over host rows, every sequence's work items in one dispatch of
/// the pool (a decode step of N sequences would otherwise wake it N times a layer for a few
/// rows each); elsewhere one after another. Each sequence gets the bits it gets alone.
pub fn attend_views_observed(
    seqs: &[SeqQuery<'_, '_>],
    t: usize,
    scale: f32,
    sinks: Option<&[f32]>,
) -> Result<Vec<(Tensor, Vec<f32>)>> {
    if seqs.iter().all(|s| on_host(s.qs, s.view)) {
        for s in seqs {
            check_queries(s.qs, s.view, t, s.observe, sinks)?;
        }
        return attend_host_many(seqs, t, scale, sinks, false);
    }
    seqs.iter()
        .map(|s| attend_view_observed(s.qs, s.view, t, scale, sinks, s.observe))
        .collect()
}

/// What one sequence's host attention needs besides its view's rows: its queries flattened (and
/// Hadamard-rotated where the cache stores rows so), its parts as key ranges, and its sizes.
struct Prepared<'a, 'b> {
    q: Vec<Vec<f32>>,
    segs: Vec<Seg<'a, 'b>>,
    nkv: usize,
    gt: usize,
    hd: usize,
    shift: usize,
    kv_len: usize,
    offset: usize,
    window: Option<usize>,
    hadamard: Option<usize>,
    observe: usize,
}

impl<'a, 'b> Prepared<'a, 'b> {
    fn new(qs: &[&Tensor], view: &'b KvView<'a>, t: usize, observe: usize) -> Result<Self> {
        let (nkv, gt, hd) = qs[0].dims3()?;
        let mut q: Vec<Vec<f32>> = Vec::with_capacity(qs.len());
        for x in qs {
            ensure!(
                x.dims3()? == (nkv, gt, hd),
                "query rotations differ in shape"
            );
            q.push(
                x.flatten_all()?
                    .to_dtype(candle_core::DType::F32)?
                    .to_vec1()?,
            );
        }
        if let Some(b) = view.hadamard {
            ensure!(
                hd % b == 0,
                "Hadamard block {b} does not divide head_dim {hd}"
            );
            for x in &mut q {
                kvrows::hadamard(x, b);
            }
        }
        // Key chunks sit at multiples of CHUNK in absolute positions where the view's positions
        // are consecutive (`KvView::first`): view index j is virtual index j + shift, and the
        // virtual keys before `shift` are seen by no row.
        let shift = view.first % CHUNK;
        let mut segs = Vec::with_capacity(view.parts.len());
        let mut kv_len = 0;
        for p in &view.parts {
            let n = p.rows.len();
            let ok = with_host_rows!(&p.rows, |x, C| fits(x, nkv, C::row_len(hd)), dense => false);
            ensure!(
                ok,
                "a KV view's rows do not hold {n} positions of {nkv} heads × {hd}"
            );
            if n > 0 {
                segs.push(Seg {
                    rows: &p.rows,
                    start: shift + kv_len,
                    end: shift + kv_len + n,
                    query: p.query.index(),
                });
            }
            kv_len += n;
        }
        if t == 0 || gt % t != 0 || t > kv_len {
            bail!("attention: {t} queries do not fit q rows {gt} / keys {kv_len}");
        }
        Ok(Self {
            q,
            segs,
            nkv,
            gt,
            hd,
            shift,
            kv_len,
            offset: shift + kv_len - t,
            window: view.window,
            hadamard: view.hadamard,
            observe,
        })
    }

    /// Chunks of keys, counted from the virtual start.
    fn n_chunks(&self) -> usize {
        (self.shift + self.kv_len).div_ceil(CHUNK)
    }
}

/// The fused kernel over several sequences' host rows in one dispatch ([`attend_host_at`] is
/// the case of one).
fn attend_host_many(
    seqs: &[SeqQuery<'_, '_>],
    t: usize,
    scale: f32,
    sinks: Option<&[f32]>,
    portable: bool,
) -> Result<Vec<(Tensor, Vec<f32>)>> {
    let prep = seqs
        .iter()
        .map(|s| Prepared::new(s.qs, s.view, t, s.observe))
        .collect::<Result<Vec<_>>>()?;
    // Observed rows: each one's numerators exp(x − m_c) over all keys and its chunks' [m_c, s_c],
    // written by the work items (disjoint: one (row, chunk) each), normalized below.
    let mut bufs: Vec<(Vec<f32>, Vec<f32>)> = prep
        .iter()
        .map(|p| {
            let rows = p.nkv * (p.gt / t) * p.observe;
            (
                vec![0f32; rows * p.kv_len],
                vec![0f32; rows * p.n_chunks() * 2],
            )
        })
        .collect();
    let sinks_of = sinks.map(|logits| Sinks { logits, t });
    let mut outs = {
        let obs: Vec<Observe> = prep
            .iter()
            .zip(bufs.iter_mut())
            .map(|(p, (nums, ms))| Observe {
                rows: p.observe,
                nums: DisjointOut::new(nums),
                ms: DisjointOut::new(ms),
                kv_len: p.kv_len,
                n_chunks: p.n_chunks(),
            })
            .collect();
        let cxs: Vec<Ctx> = prep
            .iter()
            .zip(&obs)
            .map(|(p, obs)| Ctx {
                shift: p.shift,
                obs: (p.observe > 0).then_some(obs),
                segs: &p.segs,
                q: &p.q,
                gt: p.gt,
                hd: p.hd,
                t,
                offset: p.offset,
                window: p.window,
                scale,
            })
            .collect();
        let jobs: Vec<Job> = prep
            .iter()
            .map(|p| Job {
                nkv: p.nkv,
                gt: p.gt,
                hd: p.hd,
                kv_len: p.shift + p.kv_len,
                sinks: sinks_of,
            })
            .collect();
        // Every row is computed alone, chunk by chunk over fixed key ranges, and the chunks
        // combined in order (see `CHUNK`): the split of rows and chunks over threads never
        // changes the bits, nor does the split of the positions into parts, nor the other
        // sequences of the batch.
        let chunk = |j: usize,
                     h: usize,
                     r0: usize,
                     rows: usize,
                     c: usize,
                     scratch: &mut [f32],
                     parts: &mut [f32]| {
            run_tile_chunk(&cxs[j], (h, r0, rows, c), scratch, parts, portable)
        };
        chunked_attention(&jobs, &chunk)
    };
    let mut results = Vec::with_capacity(seqs.len());
    for ((s, p), ((nums, ms), out)) in seqs.iter().zip(&prep).zip(bufs.iter().zip(outs.drain(..))) {
        let mut out = out;
        if let Some(b) = p.hadamard {
            kvrows::hadamard(&mut out, b);
        }
        let observed = observed_weights(
            nums,
            ms,
            (p.nkv, (p.gt / t) * p.observe, p.kv_len, p.n_chunks()),
            p.shift,
            sinks,
        );
        results.push((
            Tensor::from_vec(out, (p.nkv, p.gt, p.hd), s.qs[0].device())?,
            observed,
        ));
    }
    Ok(results)
}

/// `[nkv, L]`: per KV head, the softmax weights of its `rows` observed rows summed, from each
/// row's numerators exp(x − m_c) (`nums`, `[nkv, rows, L]`) and its chunks' `[m_c, s_c]` (`ms`,
/// `[nkv, rows, n_chunks, 2]`): weight = exp(x − m_c) · exp(m_c − M) / Σ_c s_c · exp(m_c − M),
/// M the row's largest m_c, as [`combine`] weighs the chunks; key j is in chunk (j + shift) / CHUNK.
/// With `sinks` (one per query head; `rows` = g heads × the observed rows) the sink joins the
/// denominator as it does in [`combine`].
fn observed_weights(
    nums: &[f32],
    ms: &[f32],
    (nkv, rows, kv_len, n_chunks): (usize, usize, usize, usize),
    shift: usize,
    sinks: Option<&[f32]>,
) -> Vec<f32> {
    if rows == 0 {
        return Vec::new();
    }
    let mut out = vec![0f32; nkv * kv_len];
    for h in 0..nkv {
        let acc = &mut out[h * kv_len..][..kv_len];
        for r in 0..rows {
            let row = h * rows + r;
            let chunks = &ms[row * n_chunks * 2..][..n_chunks * 2];
            let seen = || chunks.chunks_exact(2).filter(|c| c[1] > 0.0);
            let m = seen().fold(f32::NEG_INFINITY, |m, c| m.max(c[0]));
            // Query head of row r: h·g + r / (rows / g), g = sinks per KV head.
            let sink = sinks.map(|s| {
                let g = s.len() / nkv;
                s[h * g + r / (rows / g).max(1)]
            });
            let m = sink.map_or(m, |x| m.max(x));
            let s: f32 = seen()
                .map(|c| c[1] * exp_nonpositive(c[0] - m))
                .sum::<f32>()
                + sink.map_or(0.0, |x| exp_nonpositive(x - m));
            if s <= 0.0 {
                continue;
            }
            let num = &nums[row * kv_len..][..kv_len];
            for c in 0..n_chunks {
                let [mc, sc] = [chunks[2 * c], chunks[2 * c + 1]];
                if sc <= 0.0 {
                    continue;
                }
                let w = exp_nonpositive(mc - m) / s;
                let lo = (c * CHUNK).saturating_sub(shift);
                let hi = ((c + 1) * CHUNK - shift).min(kv_len);
                for (a, x) in acc[lo..hi].iter_mut().zip(&num[lo..hi]) {
                    *a += x * w;
                }
            }
        }
    }
    out
}
