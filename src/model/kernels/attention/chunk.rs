//! The split of one attention over (KV head, tile of query rows, key chunk) work items, and the
//! combination of a row's chunk partials in a fixed order (so the split never changes a result).

use super::super::disjoint::DisjointOut;
use super::*;

/// Keys per softmax chunk. Each row's attention is computed over fixed key ranges 0..C, C..2C, …:
/// per chunk the max m, Σ exp(x − m) and Σ exp(x − m)·v; then the chunks are combined in order. The
/// ranges are the same in a prefill, a decode and a recompute, so results stay bit-identical, while
/// a decode can spread one row's chunks over threads.
pub(super) const CHUNK: usize = 256;

/// One row's output from its chunk partials `[m, s, acc(hd)]` (each `w` = hd + 2 long), in order.
/// A `sink` logit joins the softmax's denominator (no value): Σ_c s_c·e^(m_c−M) + e^(sink−M), M
/// the largest of the chunks' maxima and the sink, as ggml's softmax with sinks.
pub(super) fn combine(partials: &[f32], w: usize, sink: Option<f32>, o: &mut [f32]) {
    let chunks = partials.chunks_exact(w).filter(|p| p[1] > 0.0);
    let m = chunks.clone().fold(f32::NEG_INFINITY, |m, p| m.max(p[0]));
    let m = sink.map_or(m, |x| m.max(x));
    let mut s = sink.map_or(0.0, |x| exp_nonpositive(x - m));
    o.fill(0.0);
    for p in chunks {
        let scale = exp_nonpositive(p[0] - m);
        s += p[1] * scale;
        for (oe, a) in o.iter_mut().zip(&p[2..]) {
            *oe += a * scale;
        }
    }
    let inv = 1.0 / s;
    for oe in o.iter_mut() {
        *oe *= inv;
    }
}

/// One (KV head, tile of rows, key chunk) partial: `(h, r0, rows, c, scratch, parts)` writes row r's
/// `[m, s, acc(hd)]` at `parts[r·(hd+2)..]`; `scratch` holds [`scratch_len`] floats.
pub(super) type ChunkFn<'a> =
    dyn Fn(usize, usize, usize, usize, &mut [f32], &mut [f32]) + Sync + 'a;

/// A sink logit per query head, and the step's t rows per head: row r of KV head h is query
/// head h·(gt/t) + r/t.
#[derive(Clone, Copy)]
pub(super) struct Sinks<'a> {
    pub logits: &'a [f32],
    pub t: usize,
}

impl Sinks<'_> {
    fn of(s: Option<Self>, gt: usize, h: usize, r: usize) -> Option<f32> {
        s.map(|s| s.logits[h * (gt / s.t) + r / s.t])
    }
}

/// Runs `chunk` over every (tile, key chunk) of `[nkv, gt]` query rows and `kv_len` keys on candle's
/// pool, and combines each row's chunks in order into the output `[nkv, gt, hd]`. A prefill has
/// plenty of tiles: an item is a tile with all its chunks. A decode has few rows: an item is a
/// (tile, chunk), so one row's keys spread over the threads. Both give the same bits.
pub(super) fn chunked_attention(
    nkv: usize,
    gt: usize,
    hd: usize,
    kv_len: usize,
    sinks: Option<Sinks<'_>>,
    chunk: &ChunkFn<'_>,
) -> Vec<f32> {
    let tiles_per_head = gt.div_ceil(TILE);
    let n_tiles = nkv * tiles_per_head;
    let n_chunks = kv_len.div_ceil(CHUNK);
    let w = hd + 2;
    let tile = |i: usize| {
        let (h, r0) = (i / tiles_per_head, (i % tiles_per_head) * TILE);
        (h, r0, TILE.min(gt - r0))
    };
    let mut out = vec![0f32; nkv * gt * hd];
    let pool = candle_core::utils::barrier_pool();
    let threads = pool.n_workers() + 1; // the workers and this thread
    if n_tiles >= 4 * threads || n_chunks == 1 {
        let dst = DisjointOut::new(&mut out);
        pool.execute_chunked(n_tiles, |range| {
            let mut scratch = vec![0f32; scratch_len(hd)];
            let mut tmp = vec![0f32; TILE * w];
            let mut partials = vec![0f32; TILE * n_chunks * w];
            for item in range {
                let (h, r0, rows) = tile(item);
                for c in 0..n_chunks {
                    chunk(h, r0, rows, c, &mut scratch, &mut tmp);
                    for r in 0..rows {
                        partials[(r * n_chunks + c) * w..][..w]
                            .copy_from_slice(&tmp[r * w..(r + 1) * w]);
                    }
                }
                for r in 0..rows {
                    // SAFETY (DisjointOut's contract): row (h, r0 + r) belongs to this tile alone.
                    let o = unsafe { dst.slice((h * gt + r0 + r) * hd, hd) };
                    let sink = Sinks::of(sinks, gt, h, r0 + r);
                    combine(&partials[r * n_chunks * w..][..n_chunks * w], w, sink, o);
                }
            }
        });
    } else {
        let mut partials = vec![0f32; nkv * gt * n_chunks * w];
        let dst = DisjointOut::new(&mut partials);
        pool.execute_chunked(n_tiles * n_chunks, |range| {
            let mut scratch = vec![0f32; scratch_len(hd)];
            let mut tmp = vec![0f32; TILE * w];
            for item in range {
                let c = item % n_chunks;
                let (h, r0, rows) = tile(item / n_chunks);
                chunk(h, r0, rows, c, &mut scratch, &mut tmp);
                for r in 0..rows {
                    // SAFETY (DisjointOut's contract): partial (row, c) belongs to this item alone.
                    let part = unsafe { dst.slice(((h * gt + r0 + r) * n_chunks + c) * w, w) };
                    part.copy_from_slice(&tmp[r * w..(r + 1) * w]);
                }
            }
        });
        for (row, o) in out.chunks_exact_mut(hd).enumerate() {
            let sink = Sinks::of(sinks, gt, row / gt, row % gt);
            combine(&partials[row * n_chunks * w..][..n_chunks * w], w, sink, o);
        }
    }
    out
}
