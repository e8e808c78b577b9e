//! A CPU matrix kernel for Q4_1 weights: candle 0.11's Q4_1 × Q8_1 dot product is its generic scalar
//! loop (only Q4_K/Q6_K/Q8_0 get SIMD paths), and Q4_1 is the default model's type.
//!
//! Same block formats and the same arithmetic as candle's `QMatMul` (activations quantized to Q8_1
//! per 32 values; per block an exact integer dot product, then `sumf += sumi·dx·dy + mx·sy` in block
//! order), so results are bit-identical to it — only the integer part runs in AVX2. Work is split
//! over candle's own barrier pool, as candle splits its matmuls.
//!
//! Blocks of 32 weights: Q4_1 = {d: f16, m: f16, qs: [u8; 16]} with w = d·q + m, q ∈ 0..16 (low nibbles
//! hold elements 0..16, high nibbles 16..32); Q8_1 = {d: f16, s: f16 = d·Σq, qs: [i8; 32]}.

use anyhow::{bail, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use half::f16;
use std::sync::Arc;

const QK: usize = 32;

#[derive(Clone, Copy)]
#[repr(C)]
struct BlockQ4_1 {
    d: f16,
    m: f16,
    qs: [u8; QK / 2],
}

#[derive(Clone, Copy)]
#[repr(C)]
struct BlockQ8_1 {
    d: f16,
    s: f16,
    qs: [i8; QK],
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

/// Σ over blocks of (integer dot)·dx·dy + mx·sy: the portable version, candle's loop.
fn vec_dot_scalar(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
    let mut sumf = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let mut sumi = 0i32;
        for j in 0..QK / 2 {
            let v0 = x.qs[j] as i32 & 0x0F;
            let v1 = x.qs[j] as i32 >> 4;
            sumi += v0 * y.qs[j] as i32 + v1 * y.qs[j + QK / 2] as i32;
        }
        sumf += sumi as f32 * x.d.to_f32() * y.d.to_f32() + x.m.to_f32() * y.s.to_f32();
    }
    sumf
}

/// The same sum with the integer dot product of each block in AVX2: nibbles unpacked to 32 u8,
/// multiplied by the 32 i8 activations and pair-summed (`maddubs`: at most 2·15·128, no saturation),
/// then widened and summed to one i32 — exactly the scalar `sumi`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vec_dot_avx2(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
    use std::arch::x86_64::*;
    let mask = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let mut sumf = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let q = _mm_loadu_si128(x.qs.as_ptr() as *const __m128i);
        let lo = _mm_and_si128(q, mask); // elements 0..16
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask); // elements 16..32
        let xq = _mm256_set_m128i(hi, lo);
        let yq = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
        let p = _mm256_madd_epi16(_mm256_maddubs_epi16(xq, yq), ones); // [8 x i32]
        let s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
        let sumi = _mm_cvtsi128_si32(s);
        sumf += sumi as f32 * x.d.to_f32() * y.d.to_f32() + x.m.to_f32() * y.s.to_f32();
    }
    sumf
}

/// The four 8-lane i32 vectors' totals, as one [4 x i32] (integer sums: any order is exact).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn hsum4(
    p0: std::arch::x86_64::__m256i,
    p1: std::arch::x86_64::__m256i,
    p2: std::arch::x86_64::__m256i,
    p3: std::arch::x86_64::__m256i,
) -> std::arch::x86_64::__m128i {
    use std::arch::x86_64::*;
    let c = _mm256_hadd_epi32(_mm256_hadd_epi32(p0, p1), _mm256_hadd_epi32(p2, p3));
    _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1))
}

/// The 32 weights of a Q4_1 block as u8, in element order.
#[cfg(target_arch = "x86_64")]
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
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn idot(xq: std::arch::x86_64::__m256i, y: &BlockQ8_1) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let yq = _mm256_loadu_si256(y.qs.as_ptr() as *const __m256i);
    _mm256_madd_epi16(_mm256_maddubs_epi16(xq, yq), _mm256_set1_epi16(1))
}

/// Four dot products of one weight row with four activation rows, lane i for row i. Each lane
/// forms `sumf += ((sumi·dx)·dy) + (mx·sy)` block after block, exactly the scalar order (no FMA).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn vec_dot_x4_avx2(xs: &[BlockQ4_1], ys: [&[BlockQ8_1]; 4]) -> [f32; 4] {
    use std::arch::x86_64::*;
    let mut acc = _mm_setzero_ps();
    for (b, x) in xs.iter().enumerate() {
        let xq = unpack(x);
        let (y0, y1, y2, y3) = (&ys[0][b], &ys[1][b], &ys[2][b], &ys[3][b]);
        let sumi = hsum4(idot(xq, y0), idot(xq, y1), idot(xq, y2), idot(xq, y3));
        let dy = _mm_setr_ps(y0.d.to_f32(), y1.d.to_f32(), y2.d.to_f32(), y3.d.to_f32());
        let sy = _mm_setr_ps(y0.s.to_f32(), y1.s.to_f32(), y2.s.to_f32(), y3.s.to_f32());
        let t1 = _mm_mul_ps(
            _mm_mul_ps(_mm_cvtepi32_ps(sumi), _mm_set1_ps(x.d.to_f32())),
            dy,
        );
        let t2 = _mm_mul_ps(_mm_set1_ps(x.m.to_f32()), sy);
        acc = _mm_add_ps(acc, _mm_add_ps(t1, t2));
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), acc);
    out
}

/// `vec_dot` of one weight row with four activation rows.
fn vec_dot_x4(xs: &[BlockQ4_1], ys: [&[BlockQ8_1]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked at run time).
            return unsafe { vec_dot_x4_avx2(xs, ys) };
        }
    }
    ys.map(|y| vec_dot_scalar(xs, y))
}

fn vec_dot(xs: &[BlockQ4_1], ys: &[BlockQ8_1]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 is present (checked at run time).
            return unsafe { vec_dot_avx2(xs, ys) };
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

    pub fn rows(&self) -> usize {
        self.rows
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
        let mut dst = vec![0f32; m * n];
        let dst_ptr = dst.as_mut_ptr() as usize;
        let items = n.div_ceil(ROWS_PER_ITEM);
        let pool = candle_core::utils::barrier_pool();
        let row = |r: usize| &w[r * kb..(r + 1) * kb];
        let act = |t: usize| &q[t * kb..(t + 1) * kb];
        // SAFETY (the dst writes below): every (token, row) element belongs to one work item.
        let put = |t: usize, r: usize, v: f32| unsafe { *(dst_ptr as *mut f32).add(t * n + r) = v };
        if m == 1 {
            // Decode: work items are blocks of output rows.
            pool.execute_chunked(items, |range| {
                for item in range {
                    let r0 = item * ROWS_PER_ITEM;
                    for r in r0..n.min(r0 + ROWS_PER_ITEM) {
                        put(0, r, vec_dot(row(r), act(0)));
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
                    let t1 = m.min(t0 + TOKENS);
                    for r in r0..n.min(r0 + ROWS_PER_ITEM) {
                        let mut t = t0;
                        while t + 4 <= t1 {
                            let v =
                                vec_dot_x4(row(r), [act(t), act(t + 1), act(t + 2), act(t + 3)]);
                            for (i, v) in v.into_iter().enumerate() {
                                put(t + i, r, v);
                            }
                            t += 4;
                        }
                        for t in t..t1 {
                            put(t, r, vec_dot(row(r), act(t)));
                        }
                    }
                }
            });
        }
        let mut out_dims = dims;
        *out_dims.last_mut().expect("at least one dim") = n;
        Ok(Tensor::from_vec(dst, out_dims, &Device::Cpu)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QMatMul;
    use candle_core::Module;

    fn check(m: usize, k: usize, n: usize) {
        let dev = Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        let qt = QTensor::quantize(&w, GgmlDType::Q4_1).unwrap();
        let x = Tensor::randn(0f32, 1.0, (1, m, k), &dev).unwrap();
        let ours = Q4_1Matrix::from_qtensor(&qt)
            .unwrap()
            .unwrap()
            .forward(&x)
            .unwrap();
        let candle = QMatMul::from_qtensor(qt).unwrap().forward(&x).unwrap();
        assert_eq!(ours.dims(), &[1, m, n]);
        let (a, b) = (
            ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            candle.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        assert_eq!(a, b, "m={m} k={k} n={n}");
    }

    #[test]
    fn decode_matvec_is_bit_identical_to_candles_qmatmul() {
        check(1, 576, 1536);
        check(1, 64, 37);
    }

    #[test]
    fn prefill_matmul_is_bit_identical_to_candles_qmatmul() {
        check(7, 576, 192);
        check(33, 1536, 41);
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
