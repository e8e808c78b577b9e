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

use super::disjoint::DisjointOut;
use super::kvrows::{self, Codec, Decoder};
use crate::model::cache::{with_host_rows, HostRows, KvView, Rows};
use anyhow::{bail, ensure, Result};
use candle_core::Tensor;

/// Attention of the queries over a layer's view. `qs[0]` is rotated at the step's position, `qs[1]`
/// (when a part asks for it) where a window's sinks need it.
pub fn attend_view(qs: &[&Tensor], view: &KvView<'_>, t: usize, scale: f32) -> Result<Tensor> {
    ensure!(!qs.is_empty(), "attention needs queries");
    if let Some(p) = view.parts.iter().find(|p| p.query >= qs.len()) {
        bail!(
            "a part of the KV view pairs with query rotation {} that was not given",
            p.query
        );
    }
    let host = view
        .parts
        .iter()
        .all(|p| !matches!(p.rows, Rows::Dense { .. }));
    if host && qs[0].device().is_cpu() {
        return attend_host(qs, view, t, scale);
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
        let q = &rotated[p.query];
        let k = k.squeeze(0)?.to_dtype(q.dtype())?; // [nkv, len, hd]
        scores.push(q.matmul(&k.t()?)?); // [nkv, g*t, len]
        values.push(v.squeeze(0)?.to_dtype(q.dtype())?);
    }
    let scores = Tensor::cat(&scores, 2)?;
    let values = Tensor::cat(&values, 1)?.contiguous()?;
    let out = softmax_weighted(scores, &values, t, scale, view.window)?; // [nkv, g*t, hd]
    match view.hadamard {
        Some(b) => hadamard_rows(&out, b),
        None => Ok(out),
    }
}

/// `x` `[..., hd]` with each block of `b` values multiplied by the orthonormal Hadamard matrix of
/// size `b`: the rotation of quantized KV rows. On the CPU, the fast transform
/// (`kvrows::hadamard`); on another device, a matrix product there ([`hadamard_product`]), equal
/// to it to rounding.
pub fn hadamard_rows(x: &Tensor, b: usize) -> Result<Tensor> {
    if !x.device().is_cpu() {
        return hadamard_product(x, b);
    }
    ensure!(
        x.dims().last().is_some_and(|hd| hd % b == 0),
        "Hadamard block {b} does not divide the rows of {:?}",
        x.dims()
    );
    let mut xs: Vec<f32> = x
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    kvrows::hadamard(&mut xs, b);
    Ok(Tensor::from_vec(xs, x.dims(), x.device())?.to_dtype(x.dtype())?)
}

/// [`hadamard_rows`] as a matrix product on `x`'s device. The matrix is made once per thread,
/// size and device.
pub fn hadamard_product(x: &Tensor, b: usize) -> Result<Tensor> {
    use candle_core::DeviceLocation;
    use std::cell::RefCell;
    thread_local! {
        static MATRICES: RefCell<Vec<(usize, DeviceLocation, Tensor)>> = const { RefCell::new(Vec::new()) };
    }
    let dims = x.dims().to_vec();
    ensure!(
        dims.last().is_some_and(|hd| hd % b == 0),
        "Hadamard block {b} does not divide the rows of {dims:?}"
    );
    let at = x.device().location();
    let h = MATRICES.with(|m| -> Result<Tensor> {
        let mut m = m.borrow_mut();
        if let Some((_, _, h)) = m.iter().find(|(n, l, _)| *n == b && *l == at) {
            return Ok(h.clone());
        }
        // Row i of H is H applied to the unit vector e_i (H is symmetric).
        let mut xs = vec![0f32; b * b];
        for (i, row) in xs.chunks_exact_mut(b).enumerate() {
            row[i] = 1.0;
            kvrows::hadamard(row, b);
        }
        let h = Tensor::from_vec(xs, (b, b), x.device())?;
        m.push((b, at, h.clone()));
        Ok(h)
    })?;
    let n = x.elem_count() / b;
    let h = h.to_dtype(x.dtype())?;
    let x = x.contiguous()?.reshape((n, b))?; // [rows · hd / b, b]
    Ok(x.matmul(&h)?.reshape(dims)?)
}

/// `k`, `v`: `[nkv, L, hd]` tensors, attended with candle ops (the reference for the fused kernel).
pub fn attend_candle_ops(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    t: usize,
    scale: f32,
) -> Result<Tensor> {
    let scores = q.matmul(&k.t()?)?; // [nkv, g*t, L]
    softmax_weighted(scores, &v.contiguous()?, t, scale, None)
}

/// softmax(scale · scores + causal mask) · v, scores `[nkv, g*t, L]`, v `[nkv, L, hd]`; with a
/// `window`, each query also sees no key more than `window - 1` positions before it.
fn softmax_weighted(
    scores: Tensor,
    v: &Tensor,
    t: usize,
    scale: f32,
    window: Option<usize>,
) -> Result<Tensor> {
    let (nkv, gt, kv_len) = scores.dims3()?;
    let scores = (scores * scale as f64)?;
    let scores = if t > 1 || window.is_some_and(|w| w < kv_len) {
        let mask = causal_mask(t, kv_len, window, scores.device())?; // [t, L]
        scores
            .reshape((nkv, gt / t, t, kv_len))?
            .broadcast_add(&mask)?
            .reshape((nkv, gt, kv_len))?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    Ok(probs.matmul(v)?)
}

/// `[t, L]`: 0 where query i (at position L - t + i) may see key j, -inf where j is in its future
/// (or, with a `window`, `window` or more positions in its past).
pub fn causal_mask(
    t: usize,
    kv_len: usize,
    window: Option<usize>,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let offset = kv_len - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            let start = window.map_or(0, |w| (offset + i + 1).saturating_sub(w));
            (0..kv_len).map(move |j| {
                if j <= offset + i && j >= start {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (t, kv_len), device)?)
}

/// Query rows per work item of the attention kernels, side by side in the lanes of one 8-float
/// register: a key is widened once and scored against all of them, a value added into all of
/// their accumulators. Each row's arithmetic is its own (lanes never mix), so a row gives the
/// same bits whichever rows share its tile: a prefill, a decode and a recompute agree.
const TILE: usize = 8;

/// e^x for x ≤ 0, to ~2 ulp: Cephes' expf (range reduction by ln 2, degree-6 polynomial), written so
/// the loop above vectorizes (libm's expf does not).
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // e^-87 is below f32's normal range: the weight is 0 to f32 precision. Clamped to 0 above
    // (and a NaN to −87), so that the exponent bits below are always in range.
    #[allow(clippy::manual_clamp)] // clamp would keep a NaN
    let x = x.max(-87.0).min(0.0);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let p = p * r * r + r + 1.0;
    // 2^n by building the exponent bits; −126 ≤ n ≤ 0 here. The biased exponent n + 127 is read
    // from the low mantissa bits of 2^23 + n + 127 (exact: n + 127 is an integer in 1..=127, so
    // the sum lies in [2^23, 2^24), where floats are the integers), not by an
    // `as` cast, whose saturating conversion the compiler leaves scalar in every vector lane.
    const MAGIC: f32 = 8_388_608.0; // 2^23
    let biased = (n + (MAGIC + 127.0)).to_bits() - MAGIC.to_bits();
    p * f32::from_bits(biased << 23)
}

/// Keys per softmax chunk. Each row's attention is computed over fixed key ranges 0..C, C..2C, …:
/// per chunk the max m, Σ exp(x − m) and Σ exp(x − m)·v; then the chunks are combined in order. The
/// ranges are the same in a prefill, a decode and a recompute, so results stay bit-identical, while
/// a decode can spread one row's chunks over threads.
const CHUNK: usize = 256;

/// One row's output from its chunk partials `[m, s, acc(hd)]` (each `w` = hd + 2 long), in order.
fn combine(partials: &[f32], w: usize, o: &mut [f32]) {
    let chunks = partials.chunks_exact(w).filter(|p| p[1] > 0.0);
    let m = chunks.clone().fold(f32::NEG_INFINITY, |m, p| m.max(p[0]));
    let mut s = 0f32;
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
type ChunkFn<'a> = dyn Fn(usize, usize, usize, usize, &mut [f32], &mut [f32]) + Sync + 'a;

/// Runs `chunk` over every (tile, key chunk) of `[nkv, gt]` query rows and `kv_len` keys on candle's
/// pool, and combines each row's chunks in order into the output `[nkv, gt, hd]`. A prefill has
/// plenty of tiles: an item is a tile with all its chunks. A decode has few rows: an item is a
/// (tile, chunk), so one row's keys spread over the threads. Both give the same bits.
fn chunked_attention(
    nkv: usize,
    gt: usize,
    hd: usize,
    kv_len: usize,
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
                    combine(&partials[r * n_chunks * w..][..n_chunks * w], w, o);
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
            combine(&partials[row * n_chunks * w..][..n_chunks * w], w, o);
        }
    }
    out
}

/// Calls `$body` with `$x` the part's [`HostRows`] and `$dec` its format's decoder (the precision
/// table's dispatch, `model::cache`).
macro_rules! with_rows {
    ($rows:expr, |$x:ident, $dec:ident| $body:expr) => {
        with_host_rows!(
            $rows,
            |$x, C| {
                let $dec: Decoder<<C as Codec>::E> = C::decoder();
                $body
            },
            dense => unreachable!("attend_host takes host rows only")
        )
    };
}

/// Whether `x` holds `len` rows of `row_len` for each of `nkv` heads.
fn fits<E>(x: &HostRows<'_, E>, nkv: usize, row_len: usize) -> bool {
    let need = (nkv - 1)
        .checked_mul(x.head_stride)
        .and_then(|a| a.checked_add(x.len * x.row_len));
    x.row_len == row_len && need.is_some_and(|n| n <= x.k.len() && n <= x.v.len())
}

/// The positions `[start, start + rows.len())` of the view, and the queries they pair with.
struct Seg<'a, 'b> {
    rows: &'b Rows<'a>,
    start: usize,
    end: usize,
    query: usize,
}

/// Keys decoded and scored together (the score loop's independent accumulators).
const KB: usize = 8;

/// Floats of scratch one work item needs: the tile's scores `[CHUNK][TILE]`, its queries and its
/// value accumulators `[hd][TILE]` each, and `KB` widened K/V rows.
fn scratch_len(hd: usize) -> usize {
    TILE * CHUNK + 2 * hd * TILE + KB * hd
}

/// What every (tile, chunk) of one attention call shares.
struct Ctx<'a, 'b> {
    segs: &'b [Seg<'a, 'b>],
    /// Each query rotation `[nkv, gt, hd]`, flat.
    q: &'b [Vec<f32>],
    gt: usize,
    hd: usize,
    t: usize,
    /// Position of the step's first query in the view.
    offset: usize,
    window: Option<usize>,
    scale: f32,
}

/// `KB` keys' rows decoded (`n` of them; the rest repeat the first, so the loops run whole).
#[inline(always)]
fn decode_rows<'k, E>(
    rows: &'k [E],
    row_len: usize,
    first: usize,
    n: usize,
    dec: Decoder<E>,
    buf: &'k mut [f32],
) -> [&'k [f32]; KB] {
    let hd = buf.len() / KB;
    let mut bufs = buf.chunks_exact_mut(hd);
    let mut got: [&[f32]; KB] = [&[]; KB];
    for (i, g) in got.iter_mut().enumerate().take(n) {
        let row = &rows[(first + i) * row_len..][..row_len];
        *g = dec(row, bufs.next().expect("KB rows"));
    }
    std::array::from_fn(|i| if i < n { &got[i][..hd] } else { &got[0][..hd] })
}

/// Scores of the tile's rows against keys `lo..hi` of a part (positions from `start`) into
/// `scores[(j − j0)·TILE + r]`, rows side by side: every score is `scale · Σ_e q_e·k_e`, fused
/// multiply-adds over e = 0, 1, … in order, whichever rows share the tile (masking is the
/// softmax's). `qt` is the tile's queries transposed, `[hd][TILE]`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_scores<E>(
    x: &HostRows<'_, E>,
    dec: Decoder<E>,
    h: usize,
    (start, lo, hi, j0): (usize, usize, usize, usize),
    qt: &[f32],
    scale: f32,
    scores: &mut [f32],
    buf: &mut [f32],
) {
    let hd = qt.len() / TILE;
    let rows = &x.k[h * x.head_stride..];
    let mut j = lo;
    while j < hi {
        let n = (hi - j).min(KB);
        let k = decode_rows(rows, x.row_len, j - start, n, dec, buf);
        let mut acc = [[0f32; TILE]; KB];
        for (e, q) in qt.chunks_exact(TILE).enumerate().take(hd) {
            for (a, k) in acc.iter_mut().zip(&k) {
                let ke = k[e];
                for (a, q) in a.iter_mut().zip(q) {
                    *a = q.mul_add(ke, *a);
                }
            }
        }
        for (i, a) in acc.iter().enumerate().take(n) {
            let out = &mut scores[(j + i - j0) * TILE..][..TILE];
            for (o, a) in out.iter_mut().zip(a) {
                *o = a * scale;
            }
        }
        j += n;
    }
}

/// Per tile row, its chunk's softmax numerators in place over `lo..hi` (exp(score − m), 0 where
/// the row does not see the key, whose score may be anything: it is never used) and its `[m, Σ]`
/// (m = −∞, Σ = 0 where it sees none): the max, then the exponentials summed in key order. The
/// keys every row sees (all but a causal diagonal's or a window edge's) take a loop without
/// per-lane choices: written with them, the compiler makes the score loads and stores masked
/// (`vmaskmovps`, microcoded on AMD's cores). Both loops do the same operations on what a row
/// sees, so the split changes no bit.
#[inline(always)]
fn tile_softmax(
    scores: &mut [f32],
    (lo, hi, j0): (usize, usize, usize),
    (starts, ends): (&[u32; TILE], &[u32; TILE]),
) -> ([f32; TILE], [f32; TILE]) {
    // Keys a..b are seen by every row of the tile (empty where some row sees none). Lanes past
    // the tile's rows (ends 0: a decode's tile holds a KV head's few query heads) are left out:
    // their results are never read, as in `tile_values`.
    let rows = || (0..TILE).filter(|&r| ends[r] != 0);
    let a = (rows().map(|r| starts[r]).max().unwrap_or(u32::MAX) as usize).clamp(lo, hi);
    let b = (rows().map(|r| ends[r]).min().unwrap_or(0) as usize).clamp(a, hi);
    let spans = [(lo, a, true), (a, b, false), (b, hi, true)];
    let mut m = [f32::NEG_INFINITY; TILE];
    for &(lo, hi, masked) in &spans {
        if masked {
            softmax_max::<true>(scores, (lo, hi, j0), (starts, ends), &mut m);
        } else {
            softmax_max::<false>(scores, (lo, hi, j0), (starts, ends), &mut m);
        }
    }
    let mut sum = [0f32; TILE];
    for &(lo, hi, masked) in &spans {
        if masked {
            softmax_exp::<true>(scores, (lo, hi, j0), (starts, ends), &m, &mut sum);
        } else {
            softmax_exp::<false>(scores, (lo, hi, j0), (starts, ends), &m, &mut sum);
        }
    }
    (m, sum)
}

/// Whether row r sees key j (always, unless `MASKED`).
#[inline(always)]
fn sees<const MASKED: bool>(
    j: usize,
    r: usize,
    (starts, ends): (&[u32; TILE], &[u32; TILE]),
) -> bool {
    !MASKED || (starts[r] <= j as u32 && (j as u32) < ends[r])
}

/// `m[r]` raised to the scores of keys `lo..hi` row r sees.
#[inline(always)]
fn softmax_max<const MASKED: bool>(
    scores: &[f32],
    (lo, hi, j0): (usize, usize, usize),
    bounds: (&[u32; TILE], &[u32; TILE]),
    m: &mut [f32; TILE],
) {
    for j in lo..hi {
        let s = &scores[(j - j0) * TILE..][..TILE];
        for r in 0..TILE {
            m[r] = if sees::<MASKED>(j, r, bounds) {
                m[r].max(s[r])
            } else {
                m[r]
            };
        }
    }
}

/// Scores of keys `lo..hi` replaced by their numerators, added into `sum` in key order.
#[inline(always)]
fn softmax_exp<const MASKED: bool>(
    scores: &mut [f32],
    (lo, hi, j0): (usize, usize, usize),
    bounds: (&[u32; TILE], &[u32; TILE]),
    m: &[f32; TILE],
    sum: &mut [f32; TILE],
) {
    for j in lo..hi {
        let s = &mut scores[(j - j0) * TILE..][..TILE];
        for r in 0..TILE {
            let sees = sees::<MASKED>(j, r, bounds);
            // The exponential's argument is chosen first: for a row that sees no key m is −∞.
            let p = exp_nonpositive(if sees { s[r] - m[r] } else { f32::NEG_INFINITY });
            s[r] = if sees { p } else { 0.0 };
            sum[r] = if sees { sum[r] + p } else { sum[r] };
        }
    }
}

/// Adds weights × values `lo..hi` of a part into the tile's accumulators `acc [hd][TILE]`: per
/// row and value element, fused multiply-adds over the keys it sees, in order. A key some row of
/// the tile does not see (the causal diagonal, a window's edge, padding rows) leaves that row's
/// accumulators untouched, lane by lane, so no bit of a row depends on its neighbours (not even
/// through a weight-0 product with an infinite value).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn tile_values<E>(
    x: &HostRows<'_, E>,
    dec: Decoder<E>,
    h: usize,
    (start, lo, hi, j0): (usize, usize, usize, usize),
    (starts, ends): (&[u32; TILE], &[u32; TILE]),
    scores: &[f32],
    acc: &mut [f32],
    buf: &mut [f32],
) {
    let rows = &x.v[h * x.head_stride..];
    let mut j = lo;
    while j < hi {
        let n = (hi - j).min(KB);
        let v = decode_rows(rows, x.row_len, j - start, n, dec, buf);
        let p: [&[f32; TILE]; KB] = std::array::from_fn(|i| {
            let at = (j + i.min(n - 1) - j0) * TILE;
            scores[at..at + TILE].try_into().expect("TILE")
        });
        // Lanes past the tile's rows (ends 0) are never read: they need no mask.
        let sees: [[bool; TILE]; KB] = std::array::from_fn(|i| {
            let k = (j + i) as u32;
            std::array::from_fn(|r| ends[r] == 0 || (starts[r] <= k && k < ends[r]))
        });
        if sees.iter().take(n).all(|s| s.iter().all(|&s| s)) {
            add_values::<false>(acc, &v, &p, &sees, n);
        } else {
            add_values::<true>(acc, &v, &p, &sees, n);
        }
        j += n;
    }
}

/// `acc [hd][TILE] += p[i] · v[i]` over keys i < n, per lane; where `MASKED`, only in the lanes
/// that see key i.
#[inline(always)]
fn add_values<const MASKED: bool>(
    acc: &mut [f32],
    v: &[&[f32]; KB],
    p: &[&[f32; TILE]; KB],
    sees: &[[bool; TILE]; KB],
    n: usize,
) {
    let hd = acc.len() / TILE;
    let fma = |r: &mut f32, p: f32, ve: f32, sees: bool| {
        let sum = p.mul_add(ve, *r);
        *r = if !MASKED || sees { sum } else { *r };
    };
    // Eight value elements of the eight rows stay in registers over the n keys.
    let mut slices = acc.chunks_exact_mut(8 * TILE);
    for (c, a) in slices.by_ref().enumerate() {
        let a: &mut [f32; 8 * TILE] = a.try_into().expect("8 · TILE");
        let mut reg: [[f32; TILE]; 8] = bytemuck::cast(*a);
        for i in 0..n {
            let v: &[f32; 8] = v[i][8 * c..8 * c + 8].try_into().expect("8");
            for (rg, &ve) in reg.iter_mut().zip(v) {
                for ((r, &p), &s) in rg.iter_mut().zip(p[i]).zip(&sees[i]) {
                    fma(r, p, ve, s);
                }
            }
        }
        *a = bytemuck::cast(reg);
    }
    // A head_dim that is not a multiple of 8: the last elements one at a time.
    let tail = slices.into_remainder();
    let e0 = hd - tail.len() / TILE;
    for (ee, a) in tail.chunks_exact_mut(TILE).enumerate() {
        for i in 0..n {
            let ve = v[i][e0 + ee];
            for ((r, &p), &s) in a.iter_mut().zip(p[i]).zip(&sees[i]) {
                fma(r, p, ve, s);
            }
        }
    }
}

/// One (KV head `h`, tile of `rows` query rows from `r0`, key chunk `c`) partial: row r's
/// `[m, s, acc(hd)]` at `parts[r·(hd+2)..]`.
#[inline(always)]
fn tile_chunk(
    cx: &Ctx<'_, '_>,
    (h, r0, rows, c): (usize, usize, usize, usize),
    scratch: &mut [f32],
    parts: &mut [f32],
) {
    let (hd, w) = (cx.hd, cx.hd + 2);
    let j0 = c * CHUNK;
    // Row r of the tile sees the keys from starts[r] (a declared window's lower bound) below
    // ends[r] (within this chunk); rows past `rows` see none.
    let mut starts = [u32::MAX; TILE];
    let mut ends = [0u32; TILE];
    for r in 0..rows {
        let own = cx.offset + (r0 + r) % cx.t; // the row's own position in the view
        ends[r] = (own + 1).min(j0 + CHUNK) as u32;
        starts[r] = cx.window.map_or(0, |w| (own + 1).saturating_sub(w)) as u32;
    }
    let most = (0..rows).map(|r| ends[r] as usize).max().unwrap_or(0);
    let least = (0..rows)
        .map(|r| (starts[r] as usize).max(j0))
        .min()
        .unwrap_or(most)
        .min(most);
    let (scores, rest) = scratch.split_at_mut(TILE * CHUNK);
    let (qt, rest) = rest.split_at_mut(hd * TILE);
    let (acc, buf) = rest.split_at_mut(hd * TILE);
    let buf = &mut buf[..KB * hd];
    let overlapping = || {
        cx.segs
            .iter()
            .filter(move |s| s.start < most && s.end > least)
    };
    for s in overlapping() {
        let span = (s.start, s.start.max(least), s.end.min(most), j0);
        qt.fill(0.0);
        for r in 0..rows {
            let q = &cx.q[s.query][(h * cx.gt + r0 + r) * hd..][..hd];
            for (e, &v) in q.iter().enumerate() {
                qt[e * TILE + r] = v;
            }
        }
        with_rows!(s.rows, |x, dec| tile_scores(
            x, dec, h, span, qt, cx.scale, scores, buf
        ));
    }
    let (m, sum) = tile_softmax(scores, (least, most, j0), (&starts, &ends));
    acc.fill(0.0);
    for s in overlapping() {
        let span = (s.start, s.start.max(least), s.end.min(most), j0);
        with_rows!(s.rows, |x, dec| tile_values(
            x,
            dec,
            h,
            span,
            (&starts, &ends),
            scores,
            acc,
            buf
        ));
    }
    for r in 0..rows {
        let p = &mut parts[r * w..(r + 1) * w];
        p[0] = m[r];
        p[1] = sum[r];
        for (e, o) in p[2..].iter_mut().enumerate() {
            *o = acc[e * TILE + r];
        }
    }
}

/// [`tile_chunk`] compiled for AVX2 and FMA: the same operations, so the same bits, as the
/// portable build (`mul_add` is one rounding either way).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_chunk_fma(
    cx: &Ctx<'_, '_>,
    item: (usize, usize, usize, usize),
    scratch: &mut [f32],
    parts: &mut [f32],
) {
    tile_chunk(cx, item, scratch, parts)
}

/// [`tile_chunk`] as this CPU runs it best, or portably (`portable`).
fn run_tile_chunk(
    cx: &Ctx<'_, '_>,
    item: (usize, usize, usize, usize),
    scratch: &mut [f32],
    parts: &mut [f32],
    portable: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if !portable && super::quant::level() >= super::quant::Level::Avx2 {
        // SAFETY: `quant::level()` is at least Avx2 only where the CPU has AVX2 and FMA (checked
        // at run time; KVCHAT_SIMD can only lower it).
        return unsafe { tile_chunk_fma(cx, item, scratch, parts) };
    }
    let _ = portable;
    tile_chunk(cx, item, scratch, parts)
}

/// The fused CPU kernel over host rows.
fn attend_host(qs: &[&Tensor], view: &KvView<'_>, t: usize, scale: f32) -> Result<Tensor> {
    attend_host_at(qs, view, t, scale, false)
}

/// [`attend_host`], its tile loops built portably where `portable` (the reference the SIMD build
/// is tested against) or as this CPU runs them best.
fn attend_host_at(
    qs: &[&Tensor],
    view: &KvView<'_>,
    t: usize,
    scale: f32,
    portable: bool,
) -> Result<Tensor> {
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
                start: kv_len,
                end: kv_len + n,
                query: p.query,
            });
        }
        kv_len += n;
    }
    if t == 0 || gt % t != 0 || t > kv_len {
        bail!("attention: {t} queries do not fit q rows {gt} / keys {kv_len}");
    }
    let offset = kv_len - t;
    let cx = Ctx {
        segs: &segs,
        q: &q,
        gt,
        hd,
        t,
        offset,
        window: view.window,
        scale,
    };
    // Every row is computed alone, chunk by chunk over fixed key ranges, and the chunks combined
    // in order (see `CHUNK`): the split of rows and chunks over threads never changes the bits,
    // nor does the split of the positions into parts.
    let chunk =
        |h: usize, r0: usize, rows: usize, c: usize, scratch: &mut [f32], parts: &mut [f32]| {
            run_tile_chunk(&cx, (h, r0, rows, c), scratch, parts, portable)
        };
    let mut out = chunked_attention(nkv, gt, hd, kv_len, &chunk);
    if let Some(b) = view.hadamard {
        kvrows::hadamard(&mut out, b);
    }
    Ok(Tensor::from_vec(out, (nkv, gt, hd), qs[0].device())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::cache::Part;
    use candle_core::{DType, Device};

    #[test]
    fn fast_exp_is_within_4_ulp_of_libm_on_nonpositive_inputs() {
        for i in 0..200_000 {
            let x = -(i as f32) * 0.0005; // 0 .. -100
            let (a, b) = (exp_nonpositive(x), x.exp());
            if b < f32::MIN_POSITIVE * 1e6 {
                assert!(a < 1e-30, "x={x}: {a}");
                continue;
            }
            assert!(
                ((a - b) / b).abs() < 4.0 * f32::EPSILON,
                "x={x}: {a} vs {b}"
            );
        }
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// Keys and values `[nkv, L, hd]` encoded row by row in format C: (k rows, v rows, decoded k, decoded v).
    #[allow(clippy::type_complexity)]
    fn encoded<C: Codec>(k: &Tensor, v: &Tensor) -> (Vec<C::E>, Vec<C::E>, Tensor, Tensor) {
        let (nkv, l, hd) = k.dims3().unwrap();
        let enc = |x: &Tensor| {
            let xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            let mut rows = vec![C::E::default(); nkv * l * C::row_len(hd)];
            let mut dec = vec![0f32; nkv * l * hd];
            for (i, (x, r)) in xs
                .chunks_exact(hd)
                .zip(rows.chunks_exact_mut(C::row_len(hd)))
                .enumerate()
            {
                C::encode(x, r);
                let mut buf = vec![0f32; hd];
                dec[i * hd..(i + 1) * hd].copy_from_slice(C::decode_scalar(r, &mut buf));
            }
            let dec = Tensor::from_vec(dec, (nkv, l, hd), &Device::Cpu).unwrap();
            (rows, dec)
        };
        let ((kr, kd), (vr, vd)) = (enc(k), enc(v));
        (kr, vr, kd, vd)
    }

    /// A view of positions `0..L` of rows `[nkv, L, row_len]`, cut into parts at `cuts`.
    fn view_of<'a, E>(
        k: &'a [E],
        v: &'a [E],
        l: usize,
        row_len: usize,
        cuts: &[usize],
        wrap: fn(HostRows<'a, E>) -> Rows<'a>,
    ) -> KvView<'a> {
        let mut bounds = vec![0];
        bounds.extend(cuts.iter().copied().filter(|&c| c > 0 && c < l));
        bounds.push(l);
        let parts = bounds
            .windows(2)
            .map(|w| Part {
                rows: wrap(HostRows {
                    k: &k[w[0] * row_len..],
                    v: &v[w[0] * row_len..],
                    head_stride: l * row_len,
                    row_len,
                    len: w[1] - w[0],
                }),
                query: 0,
            })
            .collect();
        KvView {
            parts,
            hadamard: None,
            window: None,
        }
    }

    fn rand(shape: (usize, usize, usize)) -> Tensor {
        Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
    }

    #[test]
    fn fused_kernel_equals_candle_ops_for_prefill_and_decode_however_the_view_is_cut() {
        let (nkv, g, hd) = (3, 3, 64);
        // Short caches, and long ones whose keys span several softmax chunks (CHUNK = 256).
        for (t, l) in [
            (1, 1),
            (1, 17),
            (5, 5),
            (7, 30),
            (4, 33),
            (1, 257),
            (1, 700),
            (9, 600),
        ] {
            let (k, v, q) = (
                rand((nkv, l, hd)),
                rand((nkv, l, hd)),
                rand((nkv, g * t, hd)),
            );
            let (kr, vr, _, _) = encoded::<kvrows::F32>(&k, &v);
            let reference = attend_candle_ops(&q, &k, &v, t, 0.125).unwrap();
            let whole = view_of(&kr, &vr, l, hd, &[], Rows::F32);
            let fused = attend_view(&[&q], &whole, t, 0.125).unwrap();
            assert!(max_diff(&fused, &reference) < 1e-5, "t={t} L={l}");
            let cut = view_of(&kr, &vr, l, hd, &[1, l / 3, l / 2 + 1, l - 1], Rows::F32);
            let parts = attend_view(&[&q], &cut, t, 0.125).unwrap();
            assert_eq!(
                max_diff(&parts, &fused),
                0.0,
                "t={t} L={l}: parts change bits"
            );
        }
    }

    #[test]
    fn a_declared_window_limits_each_query_to_its_last_w_positions() {
        let (nkv, g, hd) = (1, 2, 64);
        for (t, l, w) in [(1, 40, 7), (5, 40, 7), (9, 600, 300), (3, 10, 16)] {
            let (k, v, q) = (
                rand((nkv, l, hd)),
                rand((nkv, l, hd)),
                rand((nkv, g * t, hd)),
            );
            let (kr, vr, _, _) = encoded::<kvrows::F32>(&k, &v);
            let mut view = view_of(&kr, &vr, l, hd, &[l / 2], Rows::F32);
            view.window = Some(w);
            let fused = attend_view(&[&q], &view, t, 0.125).unwrap();
            // Reference: each row alone over exactly its last w keys, with candle ops.
            for r in 0..t {
                let own = l - t + r;
                let from = (own + 1).saturating_sub(w);
                let (k, v) = (
                    k.narrow(1, from, own + 1 - from).unwrap(),
                    v.narrow(1, from, own + 1 - from).unwrap(),
                );
                for gi in 0..g {
                    let qr = q.narrow(1, gi * t + r, 1).unwrap();
                    let want = attend_candle_ops(&qr, &k, &v, 1, 0.125).unwrap();
                    let got = fused.narrow(1, gi * t + r, 1).unwrap();
                    assert!(max_diff(&got, &want) < 1e-5, "t={t} L={l} w={w} row {r}");
                }
            }
            // The device path (candle ops with the mask) agrees.
            let dense = KvView {
                parts: vec![Part {
                    rows: Rows::Dense {
                        k: k.unsqueeze(0).unwrap(),
                        v: v.unsqueeze(0).unwrap(),
                    },
                    query: 0,
                }],
                hadamard: None,
                window: Some(w),
            };
            let masked = attend_view(&[&q.to_dtype(DType::F32).unwrap()], &dense, t, 0.125);
            assert!(
                max_diff(&masked.unwrap(), &fused) < 1e-5,
                "device path t={t}"
            );
        }
    }

    /// A tensor's values as bits (so ±0 and NaN compare exactly).
    fn bits(t: &Tensor) -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.into_iter().map(f32::to_bits).collect()
    }

    #[test]
    fn the_simd_build_of_the_tile_loops_gives_the_portable_builds_bits() {
        // Prefill and decode shapes, a view cut in parts, a window, head dims 64, 256 and 60 (not
        // a multiple of 8), rows of the tile from two heads when t is not a multiple of 8, f16
        // and int8 rows.
        for (nkv, g, hd, t, l, w) in [
            (2, 3, 64, 13, 300, None),
            (1, 4, 256, 1, 700, None),
            (1, 4, 256, 9, 40, Some(7)),
            (3, 1, 64, 1, 1, None),
            (2, 3, 60, 11, 30, Some(9)),
        ] {
            let (k, v, q) = (
                rand((nkv, l, hd)),
                rand((nkv, l, hd)),
                rand((nkv, g * t, hd)),
            );
            let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
            let mut view = view_of(&kr, &vr, l, hd, &[l / 3], Rows::F16);
            view.window = w;
            let simd = attend_host_at(&[&q], &view, t, 0.125, false).unwrap();
            let portable = attend_host_at(&[&q], &view, t, 0.125, true).unwrap();
            assert_eq!(bits(&simd), bits(&portable), "f16 t={t} L={l} hd={hd}");
            if hd % kvrows::QK != 0 {
                continue;
            }
            let (kr, vr, _, _) = encoded::<kvrows::Q8>(&k, &v);
            let view = view_of(&kr, &vr, l, kvrows::Q8::row_len(hd), &[], Rows::Int8);
            let simd = attend_host_at(&[&q], &view, t, 0.125, false).unwrap();
            let portable = attend_host_at(&[&q], &view, t, 0.125, true).unwrap();
            assert_eq!(bits(&simd), bits(&portable), "int8 t={t} L={l} hd={hd}");
        }
    }

    #[test]
    fn a_later_positions_infinite_value_never_reaches_an_earlier_row() {
        // f16 rows store |v| > 65504 as ∞. Rows 0..8 of a prefill share a tile; key 5's value is
        // ∞, which rows 0-4 must not see: each must equal itself computed alone (a decode).
        let (nkv, g, hd, t) = (1, 1, 64, 8);
        let (k, q) = (rand((nkv, t, hd)), rand((nkv, g * t, hd)));
        let mut vs: Vec<f32> = rand((nkv, t, hd)).flatten_all().unwrap().to_vec1().unwrap();
        vs[5 * hd + 3] = 1e6;
        let v = Tensor::from_vec(vs, (nkv, t, hd), &Device::Cpu).unwrap();
        let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
        let all = attend_view(&[&q], &view_of(&kr, &vr, t, hd, &[], Rows::F16), t, 0.125).unwrap();
        for r in 0..5 {
            let n = (r + 1) * hd;
            let alone = view_of(&kr[..n], &vr[..n], r + 1, hd, &[], Rows::F16);
            let one = attend_view(&[&q.narrow(1, r, 1).unwrap()], &alone, 1, 0.125).unwrap();
            let row = all.narrow(1, r, 1).unwrap();
            assert!(
                bits(&row).iter().all(|&b| f32::from_bits(b).is_finite()),
                "row {r}"
            );
            assert_eq!(bits(&row), bits(&one), "row {r}");
        }
    }

    /// A format's rows as a view part.
    trait Wrap: Codec {
        fn wrap(x: HostRows<'_, Self::E>) -> Rows<'_>;
    }
    impl Wrap for kvrows::F16 {
        fn wrap(x: HostRows<'_, half::f16>) -> Rows<'_> {
            Rows::F16(x)
        }
    }
    impl Wrap for kvrows::Bf16 {
        fn wrap(x: HostRows<'_, half::bf16>) -> Rows<'_> {
            Rows::Bf16(x)
        }
    }
    impl Wrap for kvrows::Q8 {
        fn wrap(x: HostRows<'_, u8>) -> Rows<'_> {
            Rows::Int8(x)
        }
    }
    impl Wrap for kvrows::Q4 {
        fn wrap(x: HostRows<'_, u8>) -> Rows<'_> {
            Rows::Int4(x)
        }
    }

    /// Attention over rows stored in format C gives the bits of attention over their decoded values.
    fn stored_rows_read_in_place<C: Wrap>() {
        let (nkv, g, hd) = (2, 3, 64);
        for (t, l) in [(1, 1), (1, 300), (5, 40), (3, 600)] {
            let (k, v, q) = (
                rand((nkv, l, hd)),
                rand((nkv, l, hd)),
                rand((nkv, g * t, hd)),
            );
            let (kr, vr, kd, vd) = encoded::<C>(&k, &v);
            let (kf, vf, _, _) = encoded::<kvrows::F32>(&kd, &vd);
            let rl = C::row_len(hd);
            let stored = attend_view(
                &[&q],
                &view_of(&kr, &vr, l, rl, &[l / 2], C::wrap),
                t,
                0.125,
            );
            let widened = attend_view(&[&q], &view_of(&kf, &vf, l, hd, &[], Rows::F32), t, 0.125);
            assert_eq!(
                max_diff(&stored.unwrap(), &widened.unwrap()),
                0.0,
                "t={t} L={l}"
            );
        }
    }

    #[test]
    fn f16_bf16_int8_and_int4_rows_give_the_bits_of_their_values_widened_to_f32() {
        stored_rows_read_in_place::<kvrows::F16>();
        stored_rows_read_in_place::<kvrows::Bf16>();
        stored_rows_read_in_place::<kvrows::Q8>();
        stored_rows_read_in_place::<kvrows::Q4>();
    }

    #[test]
    fn the_hadamard_product_of_other_devices_equals_the_fast_transform_to_rounding() {
        for (hd, b) in [(64, 64), (128, 128), (96, 32)] {
            let x = Tensor::randn(0f32, 3.0, (2, 3, 5, hd), &Device::Cpu).unwrap();
            let fast = hadamard_rows(&x, b).unwrap();
            let product = hadamard_product(&x, b).unwrap();
            assert!(max_diff(&fast, &product) < 1e-5, "hd {hd}, block {b}");
            // The rotation is its own inverse.
            let back = hadamard_product(&product, b).unwrap();
            assert!(max_diff(&back, &x) < 1e-5, "hd {hd}, block {b}: H·H ≠ I");
        }
    }

    #[test]
    fn hadamard_rotated_rows_give_the_attention_of_the_plain_rows() {
        let (nkv, g, hd, t, l) = (2, 2, 64, 3, 90);
        let (k, v, q) = (
            rand((nkv, l, hd)),
            rand((nkv, l, hd)),
            rand((nkv, g * t, hd)),
        );
        let rotate = |x: &Tensor| {
            let mut xs: Vec<f32> = x.flatten_all().unwrap().to_vec1().unwrap();
            kvrows::hadamard(&mut xs, 64);
            Tensor::from_vec(xs, x.dims(), &Device::Cpu).unwrap()
        };
        let (kr, vr, _, _) = encoded::<kvrows::F32>(&rotate(&k), &rotate(&v));
        let mut view = view_of(&kr, &vr, l, hd, &[], Rows::F32);
        view.hadamard = Some(64);
        let rotated = attend_view(&[&q], &view, t, 0.125).unwrap();
        let plain = attend_candle_ops(&q, &k, &v, t, 0.125).unwrap();
        assert!(max_diff(&rotated, &plain) < 1e-5);
    }

    #[test]
    fn a_part_pairs_its_keys_with_the_query_rotation_it_names() {
        let (nkv, g, hd, t, l) = (2, 2, 64, 2, 20);
        let (k, v) = (rand((nkv, l, hd)), rand((nkv, l, hd)));
        let (q0, q1) = (rand((nkv, g * t, hd)), rand((nkv, g * t, hd)));
        let (kr, vr, _, _) = encoded::<kvrows::F32>(&k, &v);
        let mut view = view_of(&kr, &vr, l, hd, &[4], Rows::F32);
        view.parts[0].query = 1; // the first 4 positions pair with q1
        let got = attend_view(&[&q0, &q1], &view, t, 0.125).unwrap();
        let s0 = q1.matmul(&k.narrow(1, 0, 4).unwrap().t().unwrap()).unwrap();
        let s1 = q0
            .matmul(&k.narrow(1, 4, l - 4).unwrap().t().unwrap())
            .unwrap();
        let scores = Tensor::cat(&[s0, s1], 2).unwrap();
        let want = softmax_weighted(scores, &v, t, 0.125, None).unwrap();
        assert!(max_diff(&got, &want) < 1e-5);
        assert!(attend_view(&[&q0], &view, t, 0.125).is_err(), "q1 missing");
    }

    #[test]
    fn a_query_row_gives_the_same_bits_in_a_prefill_as_alone() {
        for t in [6, 700] {
            let (nkv, g, hd) = (2, 2, 64);
            let (k, v) = (rand((nkv, t, hd)), rand((nkv, t, hd)));
            let q = Tensor::randn(0f32, 1.0, (nkv, g, t, hd), &Device::Cpu).unwrap();
            let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
            let view = view_of(&kr, &vr, t, hd, &[], Rows::F16);
            let all = attend_view(&[&q.reshape((nkv, g * t, hd)).unwrap()], &view, t, 0.125);
            // The last query alone, as a decode step would see it.
            let last = q
                .narrow(2, t - 1, 1)
                .unwrap()
                .reshape((nkv, g, hd))
                .unwrap();
            let one = attend_view(&[&last], &view, 1, 0.125).unwrap();
            let all_last = all
                .unwrap()
                .reshape((nkv, g, t, hd))
                .unwrap()
                .narrow(2, t - 1, 1)
                .unwrap()
                .reshape((nkv, g, hd))
                .unwrap();
            assert_eq!(max_diff(&all_last, &one), 0.0);
        }
        let _ = DType::F32;
    }

    #[test]
    fn a_query_row_gives_the_same_bits_in_a_prefill_as_alone_under_a_window() {
        // A window's lower edge masks keys at the start of a row's range as the diagonal does at
        // its end; t = 700 spans three key chunks, so whole-chunk, edge and diagonal spans occur.
        let (nkv, g, hd, t, w) = (2, 3, 64, 700, 300);
        let (k, v) = (rand((nkv, t, hd)), rand((nkv, t, hd)));
        let q = Tensor::randn(0f32, 1.0, (nkv, g, t, hd), &Device::Cpu).unwrap();
        let (kr, vr, _, _) = encoded::<kvrows::F16>(&k, &v);
        let mut view = view_of(&kr, &vr, t, hd, &[], Rows::F16);
        view.window = Some(w);
        let all = attend_view(&[&q.reshape((nkv, g * t, hd)).unwrap()], &view, t, 0.125)
            .unwrap()
            .reshape((nkv, g, t, hd))
            .unwrap();
        // Each of the last rows alone, as a decode step at that position would see it.
        for pos in [t - 1, t - 150, w - 1, w] {
            let mut prefix = view_of(&kr, &vr, pos + 1, hd, &[], Rows::F16);
            // The rows' head stride stays the full cache's: the prefix view reads its first
            // pos + 1 positions.
            for p in &mut prefix.parts {
                if let Rows::F16(x) = &mut p.rows {
                    x.head_stride = t * hd;
                }
            }
            prefix.window = Some(w);
            let one_q = q.narrow(2, pos, 1).unwrap().reshape((nkv, g, hd)).unwrap();
            let one = attend_view(&[&one_q], &prefix, 1, 0.125).unwrap();
            let want = all
                .narrow(2, pos, 1)
                .unwrap()
                .reshape((nkv, g, hd))
                .unwrap();
            assert_eq!(max_diff(&want, &one), 0.0, "position {pos}");
        }
    }
}
