//! The fused CPU kernel's inner loops: a tile of query rows scored against keys decoded from
//! their stored format, an online softmax, and the weighted values.

use super::super::disjoint::DisjointOut;
use super::super::kvrows::{Codec, Decoder};
use super::*;
use crate::model::cache::{with_host_rows, HostRows, Rows};

/// Query rows per work item of the attention kernels, side by side in the lanes of one 8-float
/// register for the scores: a key is widened once and scored against all of them (its value is
/// then added row by row, `tile_values`). Each row's arithmetic is its own (lanes never mix), so
/// a row gives the same bits whichever rows share its tile: a prefill, a decode and a recompute
/// agree.
pub(super) const TILE: usize = 8;

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
pub(super) fn fits<E>(x: &HostRows<'_, E>, nkv: usize, row_len: usize) -> bool {
    let need = (nkv - 1)
        .checked_mul(x.head_stride)
        .and_then(|a| a.checked_add(x.len * x.row_len));
    x.row_len == row_len && need.is_some_and(|n| n <= x.k.len() && n <= x.v.len())
}

/// The positions `[start, start + rows.len())` of the view, and the queries they pair with.
pub(super) struct Seg<'a, 'b> {
    pub(super) rows: &'b Rows<'a>,
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) query: usize,
}

/// Keys decoded and scored together (the score loop's independent accumulators).
pub(super) const KB: usize = 8;

/// Floats of scratch one work item needs: the tile's scores `[CHUNK][TILE]`, its queries and its
/// value accumulators (`[hd][TILE]` and `[TILE][hd]`), and `KB` widened K/V rows.
pub(super) fn scratch_len(hd: usize) -> usize {
    TILE * CHUNK + 2 * hd * TILE + KB * hd
}

/// What every (tile, chunk) of one attention call shares.
pub(super) struct Ctx<'a, 'b> {
    /// Virtual keys before the view's first (see `attend_host_at`): seen by no row.
    pub(super) shift: usize,
    pub(super) segs: &'b [Seg<'a, 'b>],
    /// Each query rotation `[nkv, gt, hd]`, flat.
    pub(super) q: &'b [Vec<f32>],
    pub(super) gt: usize,
    pub(super) hd: usize,
    pub(super) t: usize,
    /// Position of the step's first query in the view.
    pub(super) offset: usize,
    pub(super) window: Option<usize>,
    pub(super) scale: f32,
    /// Where the step's last queries' softmax numerators go, when a cache asks for them.
    pub(super) obs: Option<&'b Observe<'b>>,
}

/// The outputs of observed query rows (the step's last `rows` rows of each query head): each
/// row's numerators exp(x − m_c) over the view's keys, `nums [nkv, g·rows, kv_len]`, and its
/// chunks' `[m_c, s_c]`, `ms [nkv, g·rows, n_chunks, 2]`.
pub(super) struct Observe<'a> {
    pub(super) rows: usize,
    pub(super) nums: DisjointOut<'a, f32>,
    pub(super) ms: DisjointOut<'a, f32>,
    pub(super) kv_len: usize,
    pub(super) n_chunks: usize,
}

/// `KB` keys' rows decoded (`n` of them; the rest repeat the first, so the loops run whole).
#[inline(always)]
pub(super) fn decode_rows<'k, E>(
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
pub(super) fn tile_scores<E>(
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
pub(super) fn tile_softmax(
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
pub(super) fn sees<const MASKED: bool>(
    j: usize,
    r: usize,
    (starts, ends): (&[u32; TILE], &[u32; TILE]),
) -> bool {
    !MASKED || (starts[r] <= j as u32 && (j as u32) < ends[r])
}

/// `m[r]` raised to the scores of keys `lo..hi` row r sees.
#[inline(always)]
pub(super) fn softmax_max<const MASKED: bool>(
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
pub(super) fn softmax_exp<const MASKED: bool>(
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

/// Adds weights × values `lo..hi` of a part into the tile's accumulators `acc [TILE][hd]`: per
/// row and value element, fused multiply-adds over the keys it sees, in order. Row by row, with
/// the value elements in the lanes: a decode's tile holds a KV head's few query heads, and a row
/// costs hd/8 vector operations a key whatever the tile's other rows. A key a row does not see
/// (the causal diagonal, a window's edge, padding rows) is skipped for that row, so no bit of a
/// row depends on its neighbours (not even through a weight-0 product with an infinite value).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) fn tile_values<E>(
    x: &HostRows<'_, E>,
    dec: Decoder<E>,
    h: usize,
    (start, lo, hi, j0): (usize, usize, usize, usize),
    (starts, ends): (&[u32; TILE], &[u32; TILE]),
    scores: &[f32],
    acc: &mut [f32],
    buf: &mut [f32],
) {
    let hd = acc.len() / TILE;
    let rows = &x.v[h * x.head_stride..];
    let mut j = lo;
    while j < hi {
        let n = (hi - j).min(KB);
        let v = decode_rows(rows, x.row_len, j - start, n, dec, buf);
        for (r, acc) in acc.chunks_exact_mut(hd).enumerate() {
            // The keys of j..j + n row r sees: one run, from its window's start to its own
            // position.
            let a = (starts[r] as usize).clamp(j, j + n);
            let b = (ends[r] as usize).clamp(a, j + n);
            if a == b {
                continue;
            }
            let p: [f32; KB] = std::array::from_fn(|i| scores[(j + i.min(n - 1) - j0) * TILE + r]);
            // The same sums either way; a whole group's constant range lets the compiler unroll
            // the key loop (without it SmolLM2 prefill at 1,024 fell from ~1,000 to ~830 tok/s).
            if a == j && b == j + KB {
                add_values(acc, &v, &p, 0..KB);
            } else {
                add_values(acc, &v, &p, a - j..b - j);
            }
        }
        j += n;
    }
}

/// `acc [hd] += p[i] · v[i]` over the keys i of `keys`, in order.
#[inline(always)]
pub(super) fn add_values(
    acc: &mut [f32],
    v: &[&[f32]; KB],
    p: &[f32; KB],
    keys: std::ops::Range<usize>,
) {
    let hd = acc.len();
    // Eight value elements stay in a register over the keys.
    let mut blocks = acc.chunks_exact_mut(8);
    for (c, a) in blocks.by_ref().enumerate() {
        let a: &mut [f32; 8] = a.try_into().expect("8");
        let mut reg = *a;
        for i in keys.clone() {
            let ve: &[f32; 8] = v[i][8 * c..8 * c + 8].try_into().expect("8");
            for (r, &ve) in reg.iter_mut().zip(ve) {
                *r = p[i].mul_add(ve, *r);
            }
        }
        *a = reg;
    }
    // A head_dim that is not a multiple of 8: the last elements one at a time.
    let tail = blocks.into_remainder();
    let e0 = hd - tail.len();
    for (ee, r) in tail.iter_mut().enumerate() {
        for i in keys.clone() {
            *r = p[i].mul_add(v[i][e0 + ee], *r);
        }
    }
}

/// One (KV head `h`, tile of `rows` query rows from `r0`, key chunk `c`) partial: row r's
/// `[m, s, acc(hd)]` at `parts[r·(hd+2)..]`.
#[inline(always)]
pub(super) fn tile_chunk(
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
        starts[r] = cx
            .window
            .map_or(0, |w| (own + 1).saturating_sub(w))
            .max(cx.shift) as u32;
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
    if let Some(obs) = cx.obs {
        observe_rows(
            cx,
            obs,
            (h, r0, rows, c),
            scores,
            (least, most, j0),
            (&m, &sum),
        );
    }
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
            *o = acc[r * hd + e];
        }
    }
}

/// Copies the numerators and `[m, s]` of the tile's observed rows (see [`Observe`]) for chunk
/// `c`: keys `lo..hi` from `scores`, the chunk's other keys (unseen) left at 0.
#[inline(always)]
fn observe_rows(
    cx: &Ctx<'_, '_>,
    obs: &Observe<'_>,
    (h, r0, rows, c): (usize, usize, usize, usize),
    scores: &[f32],
    (lo, hi, j0): (usize, usize, usize),
    (m, sum): (&[f32; TILE], &[f32; TILE]),
) {
    let per_head = (cx.gt / cx.t) * obs.rows;
    for r in 0..rows {
        let (head, at) = ((r0 + r) / cx.t, (r0 + r) % cx.t);
        if at + obs.rows < cx.t {
            continue;
        }
        let row = h * per_head + head * obs.rows + (at + obs.rows - cx.t);
        if hi > lo {
            // SAFETY (DisjointOut's contract): keys lo..hi of chunk c of this row belong to this
            // (tile, chunk) item alone.
            let out = unsafe { obs.nums.slice(row * obs.kv_len + lo - cx.shift, hi - lo) };
            for (j, o) in (lo..hi).zip(out) {
                *o = scores[(j - j0) * TILE + r];
            }
        }
        // SAFETY: as above, chunk c's [m, s] of this row.
        let out = unsafe { obs.ms.slice((row * obs.n_chunks + c) * 2, 2) };
        out[0] = m[r];
        out[1] = sum[r];
    }
}

/// [`tile_chunk`] compiled for AVX2 and FMA: the same operations, so the same bits, as the
/// portable build (`mul_add` is one rounding either way).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_chunk_fma(
    cx: &Ctx<'_, '_>,
    item: (usize, usize, usize, usize),
    scratch: &mut [f32],
    parts: &mut [f32],
) {
    tile_chunk(cx, item, scratch, parts)
}

/// [`tile_chunk`] as this CPU runs it best, or portably (`portable`).
pub(super) fn run_tile_chunk(
    cx: &Ctx<'_, '_>,
    item: (usize, usize, usize, usize),
    scratch: &mut [f32],
    parts: &mut [f32],
    portable: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if !portable
        && crate::model::kernels::quant::level() >= crate::model::kernels::quant::Level::Avx2
    {
        // SAFETY: `quant::level()` is at least Avx2 only where the CPU has AVX2 and FMA (checked
        // at run time; KVCHAT_SIMD can only lower it).
        return unsafe { tile_chunk_fma(cx, item, scratch, parts) };
    }
    let _ = portable;
    tile_chunk(cx, item, scratch, parts)
}
