//! Scaled dot-product attention with a causal mask, for one sequence, grouped-query.
//!
//! On CPU a fused kernel does every query row on its own, in the same order whatever the step's
//! length: a prefill, a token-by-token decode and a `--no-cache` recompute give bit-identical
//! results, and no `[rows, L]` score tensor or K/V copy is ever made. Other devices use candle ops.
//!
//! Shapes: `q` `[nkv, g*t, hd]` (the g query heads sharing a KV head, each with t rows),
//! `k`, `v` `[nkv, L, hd]` (any strides with a contiguous last dimension); the step's t queries sit
//! at the last t of the L positions. Result `[nkv, g*t, hd]`.

use super::disjoint::DisjointOut;
use crate::model::cache::{Int8View, KvView, GROUP};
use anyhow::Result;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Shape, Tensor};

/// Attention of `q` `[nkv, g*t, hd]` over whatever view the layer's cache returned.
pub fn attend_view(q: &Tensor, view: &KvView<'_>, t: usize, scale: f32) -> Result<Tensor> {
    match view {
        KvView::Dense { k, v } => attend(&k.squeeze(0)?, &v.squeeze(0)?, q, t, scale),
        KvView::Int8(iv) => attend_int8(q, iv, t, scale),
    }
}

/// `k`, `v`: `[nkv, L, hd]`.
pub fn attend(k: &Tensor, v: &Tensor, q: &Tensor, t: usize, scale: f32) -> Result<Tensor> {
    let stored = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    if q.device().is_cpu() && q.dtype() == DType::F32 && stored(k.dtype()) && k.dtype() == v.dtype()
    {
        let q = q.contiguous()?;
        return Ok(q.apply_op3_no_bwd(k, v, &CausalAttention { t, scale })?);
    }
    attend_candle_ops(q, k, v, t, scale)
}

/// The portable path (any device): scores, mask, softmax, weighted sum with candle ops.
pub fn attend_candle_ops(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    t: usize,
    scale: f32,
) -> Result<Tensor> {
    let (nkv, gt, _hd) = q.dims3()?;
    let kv_len = k.dim(1)?;
    let scores = (q.matmul(&k.t()?)? * scale as f64)?; // [nkv, g*t, L]
    let scores = if t > 1 {
        let mask = causal_mask(t, kv_len, q.device())?; // [t, L]
        scores
            .reshape((nkv, gt / t, t, kv_len))?
            .broadcast_add(&mask)?
            .reshape((nkv, gt, kv_len))?
    } else {
        scores
    };
    let probs = candle_nn::ops::softmax_last_dim(&scores)?;
    Ok(probs.matmul(&v.contiguous()?)?)
}

/// `[t, L]`: 0 where query i (at position L - t + i) may see key j, -inf where j is in its future.
pub fn causal_mask(t: usize, kv_len: usize, device: &candle_core::Device) -> Result<Tensor> {
    let offset = kv_len - t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..kv_len).map(move |j| {
                if j <= offset + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Ok(Tensor::from_vec(mask, (t, kv_len), device)?)
}

struct CausalAttention {
    t: usize,
    scale: f32,
}

/// Strides (in elements) of a `[heads, L, hd]` layout whose last dimension is contiguous.
fn strides3(l: &Layout, what: &str) -> candle_core::Result<(usize, usize)> {
    let s = l.stride();
    if s.len() != 3 || s[2] != 1 {
        candle_core::bail!(
            "attention: {what} must be [heads, L, hd] with a contiguous last dim, got {l:?}"
        );
    }
    Ok((s[0], s[1]))
}

/// Query rows per work item of the attention kernels.
const TILE: usize = 8;

/// e^x for x ≤ 0, to ~2 ulp: Cephes' expf (range reduction by ln 2, degree-6 polynomial), written so
/// the loop above vectorizes (libm's expf does not).
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.max(-87.0); // e^-87 is below f32's normal range: the weight is 0 to f32 precision
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let p = p * r * r + r + 1.0;
    // 2^n by building the exponent bits; n ≥ -126 here.
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Σ a[i]·b[i] in 16 fixed lanes: vectorizes, and always sums in the same order.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    const LANES: usize = 16;
    let n = a.len().min(b.len());
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a[..n].chunks_exact(LANES), b[..n].chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    acc.iter().sum::<f32>() + s
}

/// Keys per softmax chunk. Each row's attention is computed over fixed key ranges 0..C, C..2C, …:
/// per chunk the max m, Σ exp(x − m) and Σ exp(x − m)·v; then the chunks are combined in order. The
/// ranges are the same in a prefill, a decode and a recompute, so results stay bit-identical, while
/// a decode can spread one row's chunks over threads.
const CHUNK: usize = 256;

/// Per row of a chunk: scores → exp(score − m) in place, and `parts` row r starts [m, Σ, 0…]
/// (m = −∞, Σ = 0 for a row with no key in the chunk).
#[inline(always)]
fn chunk_softmax(
    scores: &mut [f32],
    rows: usize,
    j0: usize,
    end: impl Fn(usize) -> usize,
    parts: &mut [f32],
    w: usize,
) {
    for r in 0..rows {
        let p = &mut parts[r * w..(r + 1) * w];
        p[0] = f32::NEG_INFINITY;
        p[1] = 0.0;
        p[2..].fill(0.0);
        if end(r) > j0 {
            let row = &mut scores[r * CHUNK..r * CHUNK + end(r) - j0];
            let m = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            for x in row.iter_mut() {
                *x = exp_nonpositive(*x - m);
            }
            p[0] = m;
            p[1] = row.iter().sum();
        }
    }
}

/// An element type the cache may store keys and values in; the kernel widens each row to f32 in
/// registers-sized scratch (exact for f16 and bf16) and computes in f32.
trait Stored: Copy + Send + Sync + 'static {
    /// The row as f32: the row itself for f32, else converted into `buf`.
    fn as_f32<'b>(row: &'b [Self], buf: &'b mut [f32]) -> &'b [f32];
}

impl Stored for f32 {
    #[inline(always)]
    fn as_f32<'b>(row: &'b [f32], _buf: &'b mut [f32]) -> &'b [f32] {
        row
    }
}

impl Stored for half::f16 {
    #[inline(always)]
    fn as_f32<'b>(row: &'b [Self], buf: &'b mut [f32]) -> &'b [f32] {
        // F16C (vcvtph2ps) where the CPU has it: `half` picks it at run time.
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(row, &mut buf[..row.len()]);
        &buf[..row.len()]
    }
}

impl Stored for half::bf16 {
    #[inline(always)]
    fn as_f32<'b>(row: &'b [Self], buf: &'b mut [f32]) -> &'b [f32] {
        half::slice::HalfFloatSliceExt::convert_to_f32_slice(row, &mut buf[..row.len()]);
        &buf[..row.len()]
    }
}

/// The inputs of the dense kernel, for the work items.
struct Src<'a, E> {
    q: &'a [f32],
    k: &'a [E],
    v: &'a [E],
    k_hs: usize,
    k_ps: usize,
    v_hs: usize,
    v_ps: usize,
    gt: usize,
    hd: usize,
    t: usize,
    offset: usize,
    scale: f32,
}

impl<E: Stored> Src<'_, E> {
    /// Keys 0..visible(r) are in the past of row r (of gt rows, t queries each) of a head.
    fn visible(&self, r: usize) -> usize {
        self.offset + r % self.t + 1
    }

    /// The partial of chunk `c` for rows r0..r0+rows of KV head h, written to `parts` (row r at
    /// r·(hd + 2)) as [m, s, acc(hd)]; a row with no key in the chunk gets m = −∞, s = 0, acc = 0.
    fn chunk(
        &self,
        h: usize,
        r0: usize,
        rows: usize,
        c: usize,
        scores: &mut [f32],
        parts: &mut [f32],
    ) {
        let w = self.hd + 2;
        let (hd, j0) = (self.hd, c * CHUNK);
        let end = |r: usize| self.visible(r0 + r).min(j0 + CHUNK);
        let most = (0..rows).map(end).max().unwrap_or(0);
        let q_row = |r: usize| &self.q[(h * self.gt + r0 + r) * hd..][..hd];
        // The scratch holds TILE × (CHUNK + hd): scores first, then one widened K/V row.
        let (scores, buf) = scores.split_at_mut(TILE * CHUNK);
        let buf = &mut buf[..hd];
        // Scores, one pass over the chunk's keys.
        for j in j0..most {
            let kj = E::as_f32(&self.k[h * self.k_hs + j * self.k_ps..][..hd], buf);
            for r in 0..rows {
                if j < end(r) {
                    scores[r * CHUNK + j - j0] = dot(q_row(r), kj) * self.scale;
                }
            }
        }
        chunk_softmax(scores, rows, j0, end, parts, w);
        for j in j0..most {
            let vj = E::as_f32(&self.v[h * self.v_hs + j * self.v_ps..][..hd], buf);
            for r in 0..rows {
                if j < end(r) {
                    let pj = scores[r * CHUNK + j - j0];
                    for (oe, ve) in parts[r * w + 2..(r + 1) * w].iter_mut().zip(vj) {
                        *oe += pj * ve;
                    }
                }
            }
        }
    }
}

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
/// `[m, s, acc(hd)]` at `parts[r·(hd+2)..]`; `scratch` holds TILE·(CHUNK + hd) floats.
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
            let mut scratch = vec![0f32; TILE * (CHUNK + hd)];
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
            let mut scratch = vec![0f32; TILE * (CHUNK + hd)];
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

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "kvchat-causal-attention"
    }

    fn cpu_fwd(
        &self,
        s_q: &CpuStorage,
        l_q: &Layout,
        s_k: &CpuStorage,
        l_k: &Layout,
        s_v: &CpuStorage,
        l_v: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (nkv, gt, hd) = l_q.shape().dims3()?;
        let (nkv_k, kv_len, hd_k) = l_k.shape().dims3()?;
        if nkv_k != nkv || hd_k != hd || l_v.shape().dims3()? != (nkv, kv_len, hd) {
            candle_core::bail!(
                "attention: shapes q {:?} k {:?} v {:?}",
                l_q.shape(),
                l_k.shape(),
                l_v.shape()
            );
        }
        let t = self.t;
        if t == 0 || gt % t != 0 || t > kv_len {
            candle_core::bail!("attention: {t} queries do not fit q rows {gt} / keys {kv_len}");
        }
        let q = &s_q.as_slice::<f32>()?[l_q.start_offset()..];
        let (k_hs, k_ps) = strides3(l_k, "k")?;
        let (v_hs, v_ps) = strides3(l_v, "v")?;
        let offset = kv_len - t;
        let scale = self.scale;

        // Every row is computed alone, chunk by chunk over fixed key ranges, and the chunks combined
        // in order (see `CHUNK`): the split of rows and chunks over threads never changes the bits.
        fn run<E: Stored>(src: Src<'_, E>, nkv: usize, kv_len: usize) -> Vec<f32> {
            let (gt, hd) = (src.gt, src.hd);
            chunked_attention(nkv, gt, hd, kv_len, &|h, r0, rows, c, scratch, parts| {
                src.chunk(h, r0, rows, c, scratch, parts)
            })
        }
        macro_rules! src {
            ($ty:ty) => {
                Src {
                    q,
                    k: &s_k.as_slice::<$ty>()?[l_k.start_offset()..],
                    v: &s_v.as_slice::<$ty>()?[l_v.start_offset()..],
                    k_hs,
                    k_ps,
                    v_hs,
                    v_ps,
                    gt,
                    hd,
                    t,
                    offset,
                    scale,
                }
            };
        }
        let out = match s_k {
            CpuStorage::F16(_) => run(src!(half::f16), nkv, kv_len),
            CpuStorage::BF16(_) => run(src!(half::bf16), nkv, kv_len),
            _ => run(src!(f32), nkv, kv_len),
        };
        Ok((CpuStorage::F32(out), Shape::from((nkv, gt, hd))))
    }
}

/// Attention over an INT8 cache without dequantizing it: for key group b, a row's scores are
/// `Σ_c (q_c · s_bc) · kq_jc` (the group's channel scales folded into the query once), and the output is
/// `Σ_j p_j · s_j · vq_j` (the token's scale folded into its weight). The f32 tail follows.
pub fn attend_int8(q: &Tensor, view: &Int8View<'_>, t: usize, scale: f32) -> Result<Tensor> {
    let (nkv, gt, hd) = q.dims3()?;
    anyhow::ensure!(
        view.heads.len() == nkv && view.head_dim == hd,
        "int8 view does not match q"
    );
    let q_all: Vec<f32> = q.flatten_all()?.to_vec1()?;
    let (nq, nt) = (view.n_quant, view.n_tail);
    let kv_len = nq + nt;
    let offset = kv_len - t;
    let w = hd + 2;
    // As the dense kernel, chunk by chunk; a chunk's keys are INT8 groups (quantized positions
    // come in whole groups, GROUP divides CHUNK) and/or f32 tail positions.
    let chunk =
        |h: usize, r0: usize, rows: usize, c: usize, scratch: &mut [f32], parts: &mut [f32]| {
            let head = &view.heads[h];
            let (scores, qs) = scratch.split_at_mut(TILE * CHUNK);
            let j0 = c * CHUNK;
            let end = |r: usize| (offset + (r0 + r) % t + 1).min(j0 + CHUNK);
            let most = (0..rows).map(end).max().unwrap_or(0);
            let q_row = |r: usize| &q_all[(h * gt + r0 + r) * hd..][..hd];
            // Scores over INT8 groups: the group's channel scales folded into each query once.
            let mut j = j0;
            while j < most.min(nq) {
                let g = j / GROUP;
                let g_end = ((g + 1) * GROUP).min(most);
                let ks = &head.k_scale[g * hd..(g + 1) * hd];
                for r in 0..rows {
                    for ((x, a), b) in qs[r * hd..(r + 1) * hd].iter_mut().zip(q_row(r)).zip(ks) {
                        *x = a * b * scale;
                    }
                }
                for jj in j..g_end {
                    let kj = &head.kq[jj * hd..(jj + 1) * hd];
                    for r in (0..rows).filter(|&r| jj < end(r)) {
                        scores[r * CHUNK + jj - j0] = dot_i8(&qs[r * hd..(r + 1) * hd], kj);
                    }
                }
                j = g_end;
            }
            // Then the f32 tail, which ends with the step's own positions (causal).
            for j in j.max(nq)..most {
                let kj = &head.tail_k[(j - nq) * hd..][..hd];
                for r in (0..rows).filter(|&r| j < end(r)) {
                    scores[r * CHUNK + j - j0] = dot(q_row(r), kj) * scale;
                }
            }
            chunk_softmax(scores, rows, j0, end, parts, w);
            // Weighted sum: an INT8 token's scale folded into its weight.
            for j in j0..most {
                for r in (0..rows).filter(|&r| j < end(r)) {
                    let p = scores[r * CHUNK + j - j0];
                    let acc = &mut parts[r * w + 2..(r + 1) * w];
                    if j < nq {
                        let wt = p * head.v_scale[j];
                        for (oe, ve) in acc.iter_mut().zip(&head.vq[j * hd..(j + 1) * hd]) {
                            *oe += wt * *ve as f32;
                        }
                    } else {
                        for (oe, ve) in acc.iter_mut().zip(&head.tail_v[(j - nq) * hd..][..hd]) {
                            *oe += p * ve;
                        }
                    }
                }
            }
        };
    let out = chunked_attention(nkv, gt, hd, kv_len, &chunk);
    Ok(Tensor::from_vec(out, (nkv, gt, hd), q.device())?)
}

/// Σ a[i]·b[i] for f32 × i8, in 16 fixed lanes.
#[inline(always)]
fn dot_i8(a: &[f32], b: &[i8]) -> f32 {
    const LANES: usize = 16;
    let mut acc = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l] as f32;
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s += x * *y as f32;
    }
    acc.iter().sum::<f32>() + s
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

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

    #[test]
    fn fused_kernel_equals_candle_ops_for_prefill_and_decode() {
        let dev = Device::Cpu;
        let (nkv, g, hd, cap) = (3, 3, 64, 700);
        // A cache buffer with room to spare, read through a narrow view as the full cache does.
        let kb = Tensor::randn(0f32, 1.0, (nkv, cap, hd), &dev).unwrap();
        let vb = Tensor::randn(0f32, 1.0, (nkv, cap, hd), &dev).unwrap();
        // Short caches, and long ones whose keys span several softmax chunks (CHUNK = 256).
        for (t, kv_len) in [
            (1, 1),
            (1, 17),
            (5, 5),
            (7, 30),
            (4, 33),
            (1, 257),
            (1, 700),
            (9, 600),
        ] {
            let q = Tensor::randn(0f32, 1.0, (nkv, g * t, hd), &dev).unwrap();
            let k = kb.narrow(1, 0, kv_len).unwrap();
            let v = vb.narrow(1, 0, kv_len).unwrap();
            let fused = attend(&k, &v, &q, t, 0.125).unwrap();
            let reference = attend_candle_ops(&q, &k, &v, t, 0.125).unwrap();
            let d = max_diff(&fused, &reference);
            assert!(d < 1e-5, "t={t} L={kv_len}: differs by {d}");
        }
    }

    #[test]
    fn f16_and_bf16_storage_give_the_bits_of_their_values_widened_to_f32() {
        let dev = Device::Cpu;
        let (nkv, g, hd, cap) = (2, 3, 64, 600);
        let kb = Tensor::randn(0f32, 1.0, (nkv, cap, hd), &dev).unwrap();
        let vb = Tensor::randn(0f32, 1.0, (nkv, cap, hd), &dev).unwrap();
        for dtype in [DType::F16, DType::BF16] {
            let (k16, v16) = (kb.to_dtype(dtype).unwrap(), vb.to_dtype(dtype).unwrap());
            for (t, kv_len) in [(1, 1), (1, 300), (5, 40), (3, 600)] {
                let q = Tensor::randn(0f32, 1.0, (nkv, g * t, hd), &dev).unwrap();
                let (k, v) = (
                    k16.narrow(1, 0, kv_len).unwrap(),
                    v16.narrow(1, 0, kv_len).unwrap(),
                );
                let stored = attend(&k, &v, &q, t, 0.125).unwrap();
                let widened = attend(
                    &k.to_dtype(DType::F32).unwrap(),
                    &v.to_dtype(DType::F32).unwrap(),
                    &q,
                    t,
                    0.125,
                )
                .unwrap();
                assert_eq!(
                    max_diff(&stored, &widened),
                    0.0,
                    "{dtype:?} t={t} L={kv_len}"
                );
            }
        }
    }

    #[test]
    fn a_query_row_gives_the_same_bits_in_a_prefill_as_alone() {
        for t in [6, 700] {
            same_bits_in_a_prefill_as_alone(t);
        }
    }

    /// A prefill of t queries over t keys; its last row against that query alone (a decode step,
    /// which splits a long row's key chunks over threads).
    fn same_bits_in_a_prefill_as_alone(t: usize) {
        let dev = Device::Cpu;
        let (nkv, g, hd) = (2, 2, 64);
        let k = Tensor::randn(0f32, 1.0, (nkv, t, hd), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (nkv, t, hd), &dev).unwrap();
        let q = Tensor::randn(0f32, 1.0, (nkv, g, t, hd), &dev).unwrap();
        let all = attend(&k, &v, &q.reshape((nkv, g * t, hd)).unwrap(), t, 0.125).unwrap();
        // The last query alone, as a decode step would see it.
        let last = q
            .narrow(2, t - 1, 1)
            .unwrap()
            .reshape((nkv, g, hd))
            .unwrap();
        let one = attend(&k, &v, &last, 1, 0.125).unwrap();
        let all_last = all
            .reshape((nkv, g, t, hd))
            .unwrap()
            .narrow(2, t - 1, 1)
            .unwrap();
        assert_eq!(
            max_diff(&all_last.reshape((nkv, g, hd)).unwrap(), &one),
            0.0
        );
    }
}
