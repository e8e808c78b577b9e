//! A CPU matrix kernel for Q4_1 weights: candle 0.11's Q4_1 × Q8_1 dot product is its generic scalar
//! loop (only Q4_K/Q6_K/Q8_0 get SIMD paths), and Q4_1 is the default model's type.
//!
//! Same block formats as candle and llama.cpp (activations quantized to Q8_1 per 32 values, as
//! candle's `quantize_row_q8_1`), with llama.cpp's order of work per row (see `vec_dot_scalar`): an
//! exact integer dot product per block in AVX2, lanes scaled and accumulated in f32 with FMA, one
//! horizontal sum per row. Decode and prefill (four tokens per unpacked block) sum identically, so
//! a prefill, a decode and a `--no-cache` recompute agree to the bit; against candle's `QMatMul`
//! (which sums block by block in scalar) results differ by float rounding only (tested). Work is
//! split over candle's own barrier pool, as candle splits its matmuls.
//!
//! Blocks of 32 weights: Q4_1 = {d: f16, m: f16, qs: [u8; 16]} with w = d·q + m, q ∈ 0..16 (low nibbles
//! hold elements 0..16, high nibbles 16..32); Q8_1 = {d: f16, s: f16 = d·Σq, qs: [i8; 32]}.

use super::disjoint::DisjointOut;
use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use std::sync::Arc;

const QK: usize = 32;

#[derive(Clone, Copy)]
#[repr(C)]
pub(super) struct BlockQ4_1 {
    pub(super) d: f16,
    pub(super) m: f16,
    pub(super) qs: [u8; QK / 2],
}

#[derive(Clone, Copy)]
#[repr(C)]
pub(super) struct BlockQ8_1 {
    pub(super) d: f16,
    pub(super) s: f16,
    pub(super) qs: [i8; QK],
}

const ZERO_Q8_1: BlockQ8_1 = BlockQ8_1 {
    d: f16::ZERO,
    s: f16::ZERO,
    qs: [0; QK],
};

/// A Q4_1 weight matrix `[rows, cols]`, rows of `cols / 32` blocks: rows `row0 .. row0 + rows` of
/// a block store that several matrices may share (see [`Q4_1Matrix::stack`]).
pub struct Q4_1Matrix {
    rows: usize,
    cols: usize,
    row0: usize,
    blocks: Arc<Vec<BlockQ4_1>>,
}

/// candle's `quantize_row_q8_1`, value for value.
fn quantize_row_q8_1(xs: &[f32], ys: &mut [BlockQ8_1]) {
    for (x, y) in xs.chunks_exact(QK).zip(ys.iter_mut()) {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / ((1 << 7) - 1) as f32;
        let id = if d != 0f32 { 1. / d } else { 0. };
        y.d = f16::from_f32(d);
        let mut sum = 0i32;
        for j in 0..QK / 2 {
            let v0 = x[j] * id;
            let v1 = x[j + QK / 2] * id;
            y.qs[j] = f32::round(v0) as i8;
            y.qs[j + QK / 2] = f32::round(v1) as i8;
            sum += y.qs[j] as i32 + y.qs[j + QK / 2] as i32;
        }
        y.s = f16::from_f32(sum as f32) * y.d;
    }
}

/// How every path here sums a row: per block, the exact integer dot product in 8 lanes (lane l
/// holds elements 4l..4l+4, as AVX2's maddubs+madd leave them), each lane converted to f32 and
/// fused-multiply-added with dx·dy into its own accumulator; mx·sy summed apart; at the end the
/// 8 lanes are added pairwise ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)) and the m-sum added. This is
/// llama.cpp's order of work, and the same in decode (one token) and prefill (four at once), so a
/// prefill, a decode and a recompute give the same bits. This function is the portable version.
fn vec_dot_scalar(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
    let mut acc = [0f32; 8];
    let mut summ = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let w = |i: usize| {
            if i < QK / 2 {
                (x.qs[i] & 0x0F) as i32
            } else {
                (x.qs[i - QK / 2] >> 4) as i32
            }
        };
        let d = x.d.to_f32() * y.d.to_f32();
        for (l, a) in acc.iter_mut().enumerate() {
            let lane: i32 = (4 * l..4 * l + 4).map(|i| w(i) * y.qs[i] as i32).sum();
            *a = (lane as f32).mul_add(d, *a);
        }
        summ += x.m.to_f32() * y.s.to_f32();
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7])) + summ
}

/// Whether the AVX2+FMA kernels run (checked at run time; the result is cached by std).
#[cfg(target_arch = "x86_64")]
fn simd() -> bool {
    std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
}

/// `vec_dot` of one weight row with four activation rows.
#[inline]
fn vec_dot_x4(xs: &[BlockQ4_1], ys: [&[BlockQ8_1]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        if simd() {
            // SAFETY: AVX2 and FMA are present (checked at run time).
            return unsafe { avx2::vec_dot_x4(xs, ys) };
        }
    }
    ys.map(|y| vec_dot_scalar(xs, y))
}

#[inline]
fn vec_dot(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd() {
            // SAFETY: AVX2 and FMA are present (checked at run time).
            return unsafe { avx2::vec_dot(xs, ys) };
        }
    }
    vec_dot_scalar(xs, ys)
}

/// Output rows per work item: enough to amortize the hand-off, small enough to balance two threads.
const ROWS_PER_ITEM: usize = 16;

impl Q4_1Matrix {
    /// The matrix of a Q4_1 `QTensor` `[rows, cols]`; None for other types.
    pub fn from_qtensor(t: &QTensor) -> Result<Option<Self>> {
        if t.dtype() != GgmlDType::Q4_1 {
            return Ok(None);
        }
        let (rows, cols) = t.shape().dims2()?;
        if !cols.is_multiple_of(QK) {
            bail!("Q4_1 matrix with {cols} columns, not a multiple of {QK}");
        }
        let data = t.data()?;
        let size = std::mem::size_of::<BlockQ4_1>();
        if data.len() != rows * cols / QK * size {
            bail!(
                "Q4_1 matrix data of {} bytes for [{rows}, {cols}]",
                data.len()
            );
        }
        let blocks = data
            .chunks_exact(size)
            .map(|b| BlockQ4_1 {
                d: f16::from_le_bytes([b[0], b[1]]),
                m: f16::from_le_bytes([b[2], b[3]]),
                qs: b[4..20].try_into().expect("16 bytes"),
            })
            .collect();
        Ok(Some(Self {
            rows,
            cols,
            row0: 0,
            blocks: Arc::new(blocks),
        }))
    }

    /// The rows of `parts` stacked into one matrix (so one pass computes all their outputs: q, k
    /// and v, or gate and up), and each part as a view into it; no weight is stored twice.
    pub fn stack(parts: &[&Q4_1Matrix]) -> Result<(Q4_1Matrix, Vec<Q4_1Matrix>)> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if parts.iter().any(|p| p.cols != cols) {
            bail!("stacking Q4_1 matrices of different widths");
        }
        let kb = cols / QK;
        let mut blocks = Vec::new();
        let mut views = Vec::new();
        let mut row0 = 0;
        for p in parts {
            blocks.extend_from_slice(&p.blocks[p.row0 * kb..(p.row0 + p.rows) * kb]);
            views.push((row0, p.rows));
            row0 += p.rows;
        }
        let blocks = Arc::new(blocks);
        let view = |row0, rows| Q4_1Matrix {
            rows,
            cols,
            row0,
            blocks: blocks.clone(),
        };
        let parts = views.into_iter().map(|(r0, n)| view(r0, n)).collect();
        Ok((view(0, row0), parts))
    }

    /// `x [.., cols]` (f32) times the transposed matrix: `[.., rows]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let k = *dims.last().unwrap_or(&0);
        if k != self.cols {
            bail!(
                "Q4_1 matmul: input has {k} columns, the matrix {}",
                self.cols
            );
        }
        let m = x.elem_count() / k;
        let xs = x.flatten_all()?.to_vec1::<f32>()?;
        let kb = k / QK;
        let mut q = vec![ZERO_Q8_1; m * kb];
        for (row, out) in xs.chunks_exact(k).zip(q.chunks_exact_mut(kb)) {
            quantize_row_q8_1(row, out);
        }
        let n = self.rows;
        let w = &self.blocks[self.row0 * kb..(self.row0 + n) * kb];
        let mut out = vec![0f32; m * n];
        let dst = DisjointOut::new(&mut out);
        let items = n.div_ceil(ROWS_PER_ITEM);
        let pool = candle_core::utils::barrier_pool();
        let row = |r: usize| &w[r * kb..(r + 1) * kb];
        let act = |t: usize| &q[t * kb..(t + 1) * kb];
        if m == 1 {
            // Decode: work items are blocks of output rows.
            pool.execute_chunked(items, |range| {
                for item in range {
                    let (r0, r1) = (item * ROWS_PER_ITEM, n.min((item + 1) * ROWS_PER_ITEM));
                    // SAFETY (DisjointOut's contract): rows r0..r1 belong to this item alone.
                    let o = unsafe { dst.slice(r0, r1 - r0) };
                    for (r, o) in (r0..r1).zip(o) {
                        *o = vec_dot(row(r), act(0));
                    }
                }
            });
        } else {
            // Prefill: work items are (block of output rows, tile of TOKENS tokens); each weight
            // block is unpacked once per four tokens and stays in L1 across the tile.
            const TOKENS: usize = 16;
            let tiles = m.div_ceil(TOKENS);
            pool.execute_chunked(items * tiles, |range| {
                for item in range {
                    let (r0, t0) = ((item / tiles) * ROWS_PER_ITEM, (item % tiles) * TOKENS);
                    let (r1, t1) = (n.min(r0 + ROWS_PER_ITEM), m.min(t0 + TOKENS));
                    // SAFETY (DisjointOut's contract): rows r0..r1 of tokens t0..t1 belong to this
                    // item alone (one slice per token, as the output is [tokens, rows]).
                    let o: [&mut [f32]; TOKENS] = std::array::from_fn(|i| {
                        if t0 + i < t1 {
                            unsafe { dst.slice((t0 + i) * n + r0, r1 - r0) }
                        } else {
                            &mut []
                        }
                    });
                    for r in r0..r1 {
                        let mut t = t0;
                        while t + 4 <= t1 {
                            let v =
                                vec_dot_x4(row(r), [act(t), act(t + 1), act(t + 2), act(t + 3)]);
                            for (i, v) in v.into_iter().enumerate() {
                                o[t + i - t0][r - r0] = v;
                            }
                            t += 4;
                        }
                        for t in t..t1 {
                            o[t - t0][r - r0] = vec_dot(row(r), act(t));
                        }
                    }
                }
            });
        }
        let mut out_dims = dims;
        *out_dims.last_mut().expect("at least one dim") = n;
        Ok(Tensor::from_vec(out, out_dims, &Device::Cpu)?)
    }
}

/// The AVX2 + FMA dot products, summed in exactly `vec_dot_scalar`'s order (tested bit for bit).
/// Kept in this file: in a module of their own they measured 5-15% slower in prefill.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockQ4_1, BlockQ8_1};
    /// The 8 f32 lanes added as `vec_dot_scalar` adds them.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum_ps(acc: std::arch::x86_64::__m256) -> f32 {
        use std::arch::x86_64::*;
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1)); // a_i + a_i+4
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s)); // (0+4)+(2+6), (1+5)+(3+7)
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// One weight row with one activation row (decode), in `vec_dot_scalar`'s order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn vec_dot(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
        use std::arch::x86_64::*;
        let mut acc = _mm256_setzero_ps();
        let mut summ = 0f32;
        for (x, y) in xs.iter().zip(ys) {
            let p = idot(unpack(x), y);
            let d = _mm256_set1_ps(x.d.to_f32() * y.d.to_f32());
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc);
            summ += x.m.to_f32() * y.s.to_f32();
        }
        hsum_ps(acc) + summ
    }

    /// The 32 weights of a Q4_1 block as u8, in element order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn unpack(x: &BlockQ4_1) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let mask = _mm_set1_epi8(0x0F);
        let q = _mm_loadu_si128(x.qs.as_ptr() as *const __m128i);
        let lo = _mm_and_si128(q, mask); // elements 0..16
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask); // elements 16..32
        _mm256_set_m128i(hi, lo)
    }

    /// Integer dot products of u8 weights with i8 activations, pair-summed to [8 x i32].
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn idot(xq: std::arch::x86_64::__m256i, y: &BlockQ8_1) -> std::arch::x86_64::__m256i {
        use std::arch::x86_64::*;
        let yq = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
        _mm256_madd_epi16(_mm256_maddubs_epi16(xq, yq), _mm256_set1_epi16(1))
    }

    /// One weight row with four activation rows (prefill): each weight block unpacked once, every
    /// token's sum formed exactly as `vec_dot` forms it.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn vec_dot_x4(xs: &[BlockQ4_1], ys: [&[BlockQ8_1]; 4]) -> [f32; 4] {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut summ = [0f32; 4];
        for (b, x) in xs.iter().enumerate() {
            let xq = unpack(x);
            let (dx, mx) = (x.d.to_f32(), x.m.to_f32());
            for i in 0..4 {
                let y = &ys[i][b];
                let p = idot(xq, y);
                let d = _mm256_set1_ps(dx * y.d.to_f32());
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), d, acc[i]);
                summ[i] += mx * y.s.to_f32();
            }
        }
        [0, 1, 2, 3].map(|i| hsum_ps(acc[i]) + summ[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::Module;

    fn matrices(m: usize, k: usize, n: usize) -> (QTensor, Tensor) {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        let qt = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        (qt, Tensor::randn(0f32, 1.0, (1, m, k), &dev).unwrap())
    }

    fn flat(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    /// Against candle's QMatMul: the same quantization, another float summation order.
    fn check(m: usize, k: usize, n: usize) {
        let (qt, x) = matrices(m, k, n);
        let ours = Q4_1Matrix::from_qtensor(&qt)
            .unwrap()
            .unwrap()
            .forward(&x)
            .unwrap();
        let candle = QMatMul::from_qtensor(qt).unwrap().forward(&x).unwrap();
        assert_eq!(ours.dims(), &[1, m, n]);
        let (a, b) = (flat(&ours), flat(&candle));
        let scale = b.iter().fold(0f32, |s, v| s.max(v.abs()));
        let diff = a
            .iter()
            .zip(&b)
            .fold(0f32, |s, (x, y)| s.max((x - y).abs()));
        assert!(diff <= 1e-5 * scale, "m={m} k={k} n={n}: {diff} of {scale}");
    }

    #[test]
    fn decode_matvec_matches_candles_qmatmul_to_rounding() {
        check(1, 576, 1536);
        check(1, 64, 37);
    }

    #[test]
    fn prefill_matmul_matches_candles_qmatmul_to_rounding() {
        check(7, 576, 192);
        check(33, 1536, 41);
    }

    #[test]
    fn each_prefill_row_has_the_bits_of_that_token_decoded_alone() {
        let (qt, x) = matrices(11, 576, 96);
        let mat = Q4_1Matrix::from_qtensor(&qt).unwrap().unwrap();
        let all = flat(&mat.forward(&x).unwrap());
        for t in 0..11 {
            let one = flat(&mat.forward(&x.narrow(1, t, 1).unwrap()).unwrap());
            assert_eq!(&all[t * 96..(t + 1) * 96], &one[..], "token {t}");
        }
    }

    #[test]
    fn a_stacked_matrix_computes_each_part_exactly() {
        let dev = Device::Cpu;
        let q = |n| {
            let w = Tensor::randn(0f32, 1.0, (n, 128), &dev).unwrap();
            Q4_1Matrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_1).unwrap())
                .unwrap()
                .unwrap()
        };
        let (a, b) = (q(40), q(24));
        let x = Tensor::randn(0f32, 1.0, (1, 3, 128), &dev).unwrap();
        let (all, views) = Q4_1Matrix::stack(&[&a, &b]).unwrap();
        let all = all.forward(&x).unwrap();
        let v = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(v(all.narrow(2, 0, 40).unwrap()), v(a.forward(&x).unwrap()));
        assert_eq!(v(all.narrow(2, 40, 24).unwrap()), v(b.forward(&x).unwrap()));
        assert_eq!(v(views[1].forward(&x).unwrap()), v(b.forward(&x).unwrap()));
    }

    #[test]
    fn the_four_token_kernel_equals_the_single_dot_product() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (4, 512), &dev).unwrap();
        let mat = Q4_1Matrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_1).unwrap())
            .unwrap()
            .unwrap();
        let kb = 16;
        let x: Vec<f32> = Tensor::randn(0f32, 1.0, 4 * 512, &dev)
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut q = vec![ZERO_Q8_1; 4 * kb];
        for (row, out) in x.chunks_exact(512).zip(q.chunks_exact_mut(kb)) {
            quantize_row_q8_1(row, out);
        }
        let row = |r: usize| &mat.blocks[r * kb..(r + 1) * kb];
        let act = |t: usize| &q[t * kb..(t + 1) * kb];
        for r in 0..4 {
            let x4 = vec_dot_x4(row(r), [act(0), act(1), act(2), act(3)]);
            for (t, v) in x4.into_iter().enumerate() {
                assert_eq!(v, vec_dot(row(r), act(t)));
            }
        }
    }

    #[test]
    fn avx2_and_scalar_dot_products_agree_exactly() {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (3, 256), &dev).unwrap();
        let mat = Q4_1Matrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q4_1).unwrap())
            .unwrap()
            .unwrap();
        let x: Vec<f32> = Tensor::randn(0f32, 1.0, 256, &dev)
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut q = vec![ZERO_Q8_1; 8];
        quantize_row_q8_1(&x, &mut q);
        for r in 0..3 {
            let row = &mat.blocks[r * 8..(r + 1) * 8];
            assert_eq!(vec_dot(row, &q), vec_dot_scalar(row, &q));
        }
    }
}
