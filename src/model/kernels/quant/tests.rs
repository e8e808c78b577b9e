//! Every format against its scalar reference (the AVX2 path bit for bit), against GGUF's layout
//! (candle's quantizer and dequantizer, which follow ggml's), and the driver's properties: a
//! prefill row has the bits of that token decoded alone, a stacked matrix computes each part
//! exactly, an embedding lookup dequantizes the rows asked for.

use super::*;
use bytemuck::Zeroable;
use candle_core::quantized::{QMatMul, QTensor};
use candle_core::Module;
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};

fn rng() -> rand::rngs::StdRng {
    rand::rngs::StdRng::seed_from_u64(16)
}

/// A tensor of values in [-2, 2) drawn from `seed`: every run of a test sees the same inputs (a
/// comparison with candle that allows for rare rounding ties then passes or fails for good).
fn seeded(seed: u64, shape: impl Into<candle_core::Shape>) -> Tensor {
    let shape = shape.into();
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    let v: Vec<f32> = (0..shape.elem_count())
        .map(|_| r.random_range(-2.0f32..2.0))
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `n` random rows of `k` values, and their quantization by candle (ggml's reference quantizer).
fn quantized(dtype: WeightType, n: usize, k: usize) -> QTensor {
    let w = seeded(101, (n, k));
    QTensor::quantize(&w, dtype.candle().expect("a type candle quantizes")).unwrap()
}

/// A `[n, k]` matrix of `dtype` as GGUF bytes, and those bytes dequantized: quantized by candle
/// (ggml's reference quantizer) where candle knows the type, else by the i-quants' reference
/// quantizer and dequantized by the format.
fn gguf_matrix(dtype: WeightType, n: usize, k: usize) -> (Vec<u8>, Vec<f32>) {
    if dtype.candle().is_some() {
        let qt = quantized(dtype, n, k);
        return (
            qt.data().unwrap().to_vec(),
            flat(&qt.dequantize(&Device::Cpu).unwrap()),
        );
    }
    let w = flat(&seeded(101, (n, k)));
    match dtype {
        WeightType::IQ4_NL => of::<IQ4NL>(iquants::reference::iq4_nl(&w)),
        WeightType::IQ4_XS => of::<IQ4XS>(iquants::reference::iq4_xs(&w)),
        WeightType::MXFP4 => of::<MXFP4>(iquants::reference::mxfp4(&w)),
        // The grid types: blocks of random bytes (every index is in its grid) with a finite
        // scale, from the same seed.
        other => tiled_format!(other, |F| unreachable!("{other} has tiles"), else {
            grid_blocks(other, n * k / 256)
        }),
    }
}

/// Blocks of `F` as GGUF bytes, and their values as the format dequantizes them.
fn of<F: Format>(blocks: Vec<F::Block>) -> (Vec<u8>, Vec<f32>) {
    let mut deq = vec![0f32; blocks.len() * F::N];
    for (b, o) in blocks.iter().zip(deq.chunks_exact_mut(F::N)) {
        F::dequantize(b, o);
    }
    (bytemuck::cast_slice(&blocks).to_vec(), deq)
}

/// `count` random blocks of a grid i-quant as GGUF bytes and their dequantization.
fn grid_blocks(dtype: WeightType, count: usize) -> (Vec<u8>, Vec<f32>) {
    match dtype {
        WeightType::IQ2_XXS => of::<IQ2XXS>(random_blocks::<IQ2XXS>(count, &[0])),
        WeightType::IQ2_XS => of::<IQ2XS>(random_blocks::<IQ2XS>(count, &[0])),
        WeightType::IQ2_S => of::<IQ2S>(random_blocks::<IQ2S>(count, &[0])),
        WeightType::IQ3_XXS => of::<IQ3XXS>(random_blocks::<IQ3XXS>(count, &[0])),
        WeightType::IQ3_S => of::<IQ3S>(random_blocks::<IQ3S>(count, &[0])),
        WeightType::IQ1_S => of::<IQ1S>(random_blocks::<IQ1S>(count, &[0])),
        WeightType::IQ1_M => of::<IQ1M>(random_blocks::<IQ1M>(count, &[])),
        other => panic!("no test blocks for {other}"),
    }
}

/// Blocks of random bytes (every quant and scale value, including the extremes), with the f16
/// fields at `halves` (byte offsets) set to finite random scales.
fn random_blocks<F: Format>(n: usize, halves: &[usize]) -> Vec<F::Block> {
    let mut r = rng();
    let mut blocks = vec![F::Block::zeroed(); n];
    for b in blocks.iter_mut() {
        let bytes: &mut [u8] = bytemuck::bytes_of_mut(b);
        r.fill(bytes);
        for &o in halves {
            let h = f16::from_f32(r.random_range(-0.1f32..0.1));
            bytes[o..o + 2].copy_from_slice(&h.to_le_bytes());
        }
        // MXFP4's scale is a power of two, 2^(e − 128): kept within 2^-13..2^2 so that sums of
        // products stay finite.
        if F::DTYPE == WeightType::MXFP4 {
            bytes[0] = r.random_range(115..=130);
        }
        // IQ1_M's f16 d is the top nibbles of its four scale words (bytes 48..56).
        if F::DTYPE == WeightType::IQ1_M {
            let d = f16::from_f32(r.random_range(-0.1f32..0.1)).to_bits();
            for i in 0..4 {
                let at = 48 + 2 * i;
                let w = u16::from_le_bytes([bytes[at], bytes[at + 1]]);
                let w = (w & 0x0FFF) | (((d >> (4 * i)) & 15) << 12);
                bytes[at..at + 2].copy_from_slice(&w.to_le_bytes());
            }
        }
    }
    blocks
}

/// Activations at the extremes: every value ±1, so every quant is ±127 (the largest products
/// the integer paths must hold without saturating, against weights of random bytes).
fn extreme_activations<F: Format>(rows: usize, k: usize) -> Vec<F::Act> {
    let mut r = rng();
    let x: Vec<f32> = (0..rows * k)
        .map(|_| if r.random() { 1.0 } else { -1.0 })
        .collect();
    let mut q = vec![F::Act::zeroed(); rows * k / F::N];
    for (x, q) in x.chunks_exact(k).zip(q.chunks_exact_mut(k / F::N)) {
        F::Act::quantize(x, q);
    }
    q
}

fn activations<F: Format>(rows: usize, k: usize) -> Vec<F::Act> {
    let mut r = rng();
    let x: Vec<f32> = (0..rows * k).map(|_| r.random_range(-3f32..3.0)).collect();
    let mut q = vec![F::Act::zeroed(); rows * k / F::N];
    for (x, q) in x.chunks_exact(k).zip(q.chunks_exact_mut(k / F::N)) {
        F::Act::quantize(x, q);
    }
    q
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let scale = b.iter().fold(0f32, |s, v| s.max(v.abs()));
    let diff = a.iter().zip(b).fold(0f32, |s, (x, y)| s.max((x - y).abs()));
    (diff, scale)
}

/// The SIMD dot product (one and four tokens) against the scalar reference, bit for bit, on
/// blocks of random bytes.
fn simd_equals_scalar<F: Avx2>(halves: &[usize]) {
    for level in [Level::Avx2, Level::Vnni] {
        if level <= super::level() {
            simd_level_equals_scalar::<F>(level, halves);
        }
    }
}

fn simd_level_equals_scalar<F: Avx2>(level: Level, halves: &[usize]) {
    let kb = 8;
    let w = random_blocks::<F>(3 * kb, halves);
    for y in [
        activations::<F>(4, kb * F::N),
        extreme_activations::<F>(4, kb * F::N),
    ] {
        simd_level_equals_scalar_on::<F>(level, &w, &y, kb);
    }
}

fn simd_level_equals_scalar_on<F: Avx2>(level: Level, w: &[F::Block], y: &[F::Act], kb: usize) {
    let act = |t: usize| &y[t * kb..(t + 1) * kb];
    for r in 0..3 {
        let row = &w[r * kb..(r + 1) * kb];
        let x4 = dot_x4::<F>(level, row, [act(0), act(1), act(2), act(3)]);
        for (t, v) in x4.into_iter().enumerate() {
            let reference = dot_scalar::<F>(row, act(t));
            assert_eq!(
                v.to_bits(),
                reference.to_bits(),
                "{level:?} row {r} token {t} (x4)"
            );
            let one = dot::<F>(level, row, act(t));
            assert_eq!(
                one.to_bits(),
                reference.to_bits(),
                "{level:?} row {r} token {t}"
            );
        }
    }
}

/// The scalar dot product against f64 arithmetic on the dequantized weights and activations:
/// lanes, scales and min terms describe the same numbers `dequantize` gives.
fn scalar_dot_is_the_dequantized_dot<F: Avx2>(
    halves: &[usize],
    act_dequant: fn(&F::Act) -> Vec<f32>,
) {
    let kb = 4;
    let w = random_blocks::<F>(kb, halves);
    let y = activations::<F>(1, kb * F::N);
    let mut wf = vec![0f32; kb * F::N];
    for (x, o) in w.iter().zip(wf.chunks_exact_mut(F::N)) {
        F::dequantize(x, o);
    }
    let yf: Vec<f32> = y.iter().flat_map(act_dequant).collect();
    let exact: f64 = wf.iter().zip(&yf).map(|(a, b)| *a as f64 * *b as f64).sum();
    let norm: f64 = wf
        .iter()
        .zip(&yf)
        .map(|(a, b)| (*a as f64 * *b as f64).abs())
        .sum();
    let got = dot_scalar::<F>(&w, &y) as f64;
    assert!(
        (got - exact).abs() <= 1e-3 * norm.max(1e-6),
        "{got} vs {exact} (Σ|·| {norm})"
    );
}

/// Our matmul against candle's QMatMul on the same quantized weights: same formats, other float
/// summation order (and, for Q8_K, candle's own activation quantizer).
fn matmul_matches_candle<F: RowFormat>(m: usize, k: usize, n: usize, tolerance: f32) {
    let qt = quantized(F::DTYPE, n, k);
    let x = seeded(102, (1, m, k));
    let ours = QMatrix::from_qtensor(&qt)
        .unwrap()
        .unwrap()
        .forward(&x)
        .unwrap();
    let candle = QMatMul::from_qtensor(qt).unwrap().forward(&x).unwrap();
    assert_eq!(ours.dims(), &[1, m, n]);
    let (diff, scale) = max_diff(&flat(&ours), &flat(&candle));
    assert!(
        diff <= tolerance * scale,
        "m={m} k={k} n={n}: {diff} of {scale}"
    );
}

/// Two blocks' worth of columns (87 for the float types: a row that is no multiple of 16).
fn two_blocks<F: RowFormat>() -> usize {
    if F::N == 1 {
        87
    } else {
        2 * F::N
    }
}

/// Dequantized rows are candle's dequantization of the same rows, exactly.
fn rows_are_candles_dequantization<F: RowFormat>() {
    let k = two_blocks::<F>();
    let qt = quantized(F::DTYPE, 12, k);
    let all = flat(&qt.dequantize(&Device::Cpu).unwrap());
    let ours = QMatrix::from_qtensor(&qt).unwrap().unwrap();
    let got = flat(&ours.rows(&[3, 0, 11, 3]).unwrap());
    for (i, r) in [3usize, 0, 11, 3].into_iter().enumerate() {
        assert_eq!(
            &got[i * k..(i + 1) * k],
            &all[r * k..(r + 1) * k],
            "row {r}"
        );
    }
}

fn prefill_rows_have_the_bits_of_decode<F: RowFormat>(n: usize) {
    let k = two_blocks::<F>();
    let (bytes, _) = gguf_matrix(F::DTYPE, n, k);
    let mat = QMatrix::from_bytes(F::DTYPE, n, k, &bytes)
        .unwrap()
        .unwrap();
    // 21–23 tokens: a 16-token item of the prefill split, then 5–7 (four, and 1–3 left over).
    let x = seeded(103, (1, 23, k));
    for m in [21, 22, 23] {
        let all = flat(&mat.forward(&x.narrow(1, 0, m).unwrap()).unwrap());
        for t in 0..m {
            let one = flat(&mat.forward(&x.narrow(1, t, 1).unwrap()).unwrap());
            assert_eq!(&all[t * n..(t + 1) * n], &one[..], "token {t} of {m}");
        }
    }
}

macro_rules! format_tests {
    ($name:ident, $f:ty, halves = $h:expr, act = $act:expr, candle_tolerance = $tol:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn avx2_and_avx512_dots_equal_the_scalar_reference_bit_for_bit() {
                simd_equals_scalar::<$f>(&$h);
            }

            #[test]
            fn scalar_dot_equals_the_dot_of_the_dequantized_values() {
                scalar_dot_is_the_dequantized_dot::<$f>(&$h, $act);
            }

            #[test]
            fn matmul_matches_candles_qmatmul_to_rounding() {
                matmul_matches_candle::<$f>(1, 2 * <$f as Format>::N, 37, $tol);
                matmul_matches_candle::<$f>(7, 3 * <$f as Format>::N, 19, $tol);
            }

            #[test]
            fn embedding_rows_are_candles_dequantization_exactly() {
                rows_are_candles_dequantization::<$f>();
            }

            #[test]
            fn each_prefill_row_has_the_bits_of_that_token_decoded_alone() {
                prefill_rows_have_the_bits_of_decode::<$f>(40);
                prefill_rows_have_the_bits_of_decode::<$f>(48); // tiled where the type has tiles
            }

            #[test]
            fn matmul_in_rows_of_16_matches_candles_qmatmul_to_rounding() {
                matmul_matches_candle::<$f>(1, 2 * <$f as Format>::N, 48, $tol);
                matmul_matches_candle::<$f>(9, 2 * <$f as Format>::N, 32, $tol);
            }
        }
    };
}

fn q8_0(y: &BlockQ8_0) -> Vec<f32> {
    y.qs.iter().map(|&q| q as f32 * y.d).collect()
}
fn q8_1(y: &BlockQ8_1) -> Vec<f32> {
    y.qs.iter().map(|&q| q as f32 * y.d).collect()
}
fn q8_k(y: &BlockQ8K) -> Vec<f32> {
    y.qs.iter().map(|&q| q as f32 * y.d).collect()
}

format_tests!(
    q4_0,
    Q4_0,
    halves = [0],
    act = q8_0,
    candle_tolerance = 1e-5
);
// Q8_1 against candle's: we round ties to even and s = d·Σq to f16 once, as llama.cpp does;
// candle rounds ties away from zero and s as f16(Σq)·f16(d), so the min term m·s differs by up
// to ~2⁻¹¹ of itself (measured 1.2e-4 of the largest output).
format_tests!(
    q4_1,
    Q4_1,
    halves = [0, 2],
    act = q8_1,
    candle_tolerance = 5e-4
);
format_tests!(
    q5_0,
    Q5_0,
    halves = [0],
    act = q8_0,
    candle_tolerance = 1e-5
);
// As Q4_1.
format_tests!(
    q5_1,
    Q5_1,
    halves = [0, 2],
    act = q8_1,
    candle_tolerance = 5e-4
);
format_tests!(
    q8_0w,
    Q8_0,
    halves = [0],
    act = q8_0,
    candle_tolerance = 1e-5
);
format_tests!(
    q2_k,
    Q2K,
    halves = [80, 82],
    act = q8_k,
    candle_tolerance = 1e-5
);
format_tests!(
    q3_k,
    Q3K,
    halves = [108],
    act = q8_k,
    candle_tolerance = 1e-5
);
// Q8_0/Q8_K: we round ties to even (llama.cpp), candle away from zero: rare ties and the
// summation order differ.
format_tests!(
    q4_k,
    Q4K,
    halves = [0, 2],
    act = q8_k,
    candle_tolerance = 1e-5
);
format_tests!(
    q5_k,
    Q5K,
    halves = [0, 2],
    act = q8_k,
    candle_tolerance = 1e-5
);
format_tests!(
    q6_k,
    Q6K,
    halves = [208],
    act = q8_k,
    candle_tolerance = 1e-5
);

/// Float weights (`floats`): the AVX2 and AVX-512 dots against [`dot_ref`], bit for bit, on rows whose length
/// is not a multiple of 16, with weights of magnitudes 2⁻¹⁴…2¹⁴ (F16's normal range).
fn float_simd_equals_reference<W: floats::Float + floats::Simd>() {
    for level in [Level::Avx2, Level::Vnni] {
        if level <= super::level() {
            float_simd_level_equals_reference::<W>(level);
        }
    }
}

fn float_simd_level_equals_reference<W: floats::Float + floats::Simd>(level: Level) {
    let mut r = rng();
    // 1111: more than one block of the AVX2 4×4 kernel's columns, and a tail.
    for n in [16, 87, 576, 1111] {
        let w: Vec<W> = (0..n)
            .map(|_| W::from_f32(r.random_range(-1.0f32..1.0) * 2f32.powi(r.random_range(-14..15))))
            .collect();
        let ys: Vec<Vec<W>> = (0..4)
            .map(|_| {
                (0..n)
                    .map(|_| W::from_f32(r.random_range(-3f32..3.0)))
                    .collect()
            })
            .collect();
        let x4 = Floats::<W>::dot_x4(level, &w, [&ys[0], &ys[1], &ys[2], &ys[3]]);
        // Four rows (the same one, and three scaled copies) with the same four tokens.
        let rows: Vec<Vec<W>> = (0..4)
            .map(|i| {
                w.iter()
                    .map(|v| W::from_f32(v.value() * (i + 1) as f32))
                    .collect()
            })
            .collect();
        let y4 = [&ys[0][..], &ys[1], &ys[2], &ys[3]];
        let m4 = Floats::<W>::dot_4x4(level, [&rows[0], &rows[1], &rows[2], &rows[3]], y4);
        for (i, row) in rows.iter().enumerate() {
            for (t, y) in ys.iter().enumerate() {
                let reference = dot_ref(row, y);
                assert_eq!(
                    m4[i][t].to_bits(),
                    reference.to_bits(),
                    "{level:?} 4x4 {i} {t}"
                );
                let r4 = Floats::<W>::dot_rows4(level, [&rows[0], &rows[1], &rows[2], &rows[3]], y);
                assert_eq!(
                    r4[i].to_bits(),
                    reference.to_bits(),
                    "{level:?} rows4 {i} {t}"
                );
            }
        }
        for (t, y) in ys.iter().enumerate() {
            let reference = dot_ref(&w, y);
            let one = Floats::<W>::dot(level, &w, y);
            assert_eq!(
                one.to_bits(),
                reference.to_bits(),
                "{level:?} n={n} token {t}"
            );
            assert_eq!(
                x4[t].to_bits(),
                reference.to_bits(),
                "{level:?} n={n} token {t} (x4)"
            );
            let exact: f64 = w
                .iter()
                .zip(y)
                .map(|(a, b)| a.value() as f64 * b.value() as f64)
                .sum();
            let norm: f64 = w
                .iter()
                .zip(y)
                .map(|(a, b)| (a.value() as f64 * b.value() as f64).abs())
                .sum();
            assert!(
                (reference as f64 - exact).abs() <= 1e-5 * norm,
                "n={n}: {reference} vs {exact}"
            );
        }
    }
}

macro_rules! float_tests {
    ($name:ident, $w:ty, $tolerance:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn avx2_dot_equals_the_scalar_reference_bit_for_bit() {
                float_simd_equals_reference::<$w>();
            }

            #[test]
            fn matmul_matches_candles_matmul_to_rounding() {
                matmul_matches_candle::<Floats<$w>>(1, 576, 37, $tolerance);
                matmul_matches_candle::<Floats<$w>>(7, 100, 48, $tolerance);
            }

            #[test]
            fn embedding_rows_are_the_stored_values_exactly() {
                rows_are_candles_dequantization::<Floats<$w>>();
            }

            #[test]
            fn each_prefill_row_has_the_bits_of_that_token_decoded_alone() {
                prefill_rows_have_the_bits_of_decode::<Floats<$w>>(40);
            }

            #[test]
            fn the_driver_keeps_the_stored_type() {
                let qt = quantized(<Floats<$w>>::DTYPE, 16, 64);
                let m = QMatrix::from_qtensor(&qt).unwrap().unwrap();
                assert_eq!(m.dtype(), <Floats<$w>>::DTYPE);
            }
        }
    };
}

// F32 sums its inputs as given; F16 rounds them to F16 first (2⁻¹¹ relative), as llama.cpp does.
float_tests!(f32w, f32, 1e-5);
float_tests!(f16w, f16, 2e-3);

/// BF16 (`bf16`): its paths against its reference are tested beside it; here the driver's
/// properties, and the product of BF16-rounded activations against candle's f32 one.
mod bf16w {
    use super::*;

    #[test]
    fn matmul_matches_candles_matmul_to_the_activations_rounding() {
        // The inputs are rounded to BF16 (8 significant bits, as llama.cpp rounds them), candle
        // multiplies them in f32: each product is off by up to 2⁻⁹ of itself.
        matmul_matches_candle::<Bf16>(1, 576, 37, 1e-2);
        matmul_matches_candle::<Bf16>(7, 100, 48, 1e-2);
    }

    #[test]
    fn embedding_rows_are_the_stored_values_exactly() {
        rows_are_candles_dequantization::<Bf16>();
    }

    #[test]
    fn each_prefill_row_has_the_bits_of_that_token_decoded_alone() {
        prefill_rows_have_the_bits_of_decode::<Bf16>(40);
    }

    #[test]
    fn the_driver_keeps_the_stored_type() {
        let qt = quantized(WeightType::BF16, 16, 64);
        let m = QMatrix::from_qtensor(&qt).unwrap().unwrap();
        assert_eq!(m.dtype(), WeightType::BF16);
    }
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::*;

    #[test]
    fn q4_0_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q4_0>(&[0]);
    }

    #[test]
    fn q4_1_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q4_1>(&[0, 2]);
    }

    #[test]
    fn q5_0_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q5_0>(&[0]);
    }

    #[test]
    fn q5_1_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q5_1>(&[0, 2]);
    }

    #[test]
    fn q8_0_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q8_0>(&[0]);
    }

    #[test]
    fn q4_k_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q4K>(&[0, 2]);
    }

    #[test]
    fn q5_k_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q5K>(&[0, 2]);
    }

    #[test]
    fn q6_k_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q6K>(&[208]);
    }

    #[test]
    fn q2_k_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q2K>(&[80, 82]);
    }

    #[test]
    fn q3_k_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<Q3K>(&[108]);
    }

    /// The grid i-quants' staged tiles (made by `Tiled::pack` from the blocks, as a matmul
    /// stages them) against the row reference, at every level, on blocks of random bytes.
    #[test]
    fn grid_i_quant_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<IQ2XXS>(&[0]);
        tiles_equal_the_row_reference::<IQ2XS>(&[0]);
        tiles_equal_the_row_reference::<IQ2S>(&[0]);
        tiles_equal_the_row_reference::<IQ3XXS>(&[0]);
        tiles_equal_the_row_reference::<IQ3S>(&[0]);
        tiles_equal_the_row_reference::<IQ1S>(&[0]);
        tiles_equal_the_row_reference::<IQ1M>(&[]);
    }

    /// A decode step of a staged matrix runs each row alone in the tiles' order
    /// (`dot_rows_order`, at each level): the bits of the row reference, on blocks of random
    /// bytes with spread and extreme activations.
    #[test]
    fn grid_i_quant_rows_alone_sum_as_the_tile_reference() {
        rows_in_tile_order_equal_the_reference::<IQ2XXS>();
        rows_in_tile_order_equal_the_reference::<IQ2XS>();
        rows_in_tile_order_equal_the_reference::<IQ2S>();
        rows_in_tile_order_equal_the_reference::<IQ3XXS>();
        rows_in_tile_order_equal_the_reference::<IQ3S>();
        rows_in_tile_order_equal_the_reference::<IQ1S>();
        rows_in_tile_order_equal_the_reference::<IQ1M>();
    }

    fn rows_in_tile_order_equal_the_reference<F: Avx2>() {
        type Dot<F> = unsafe fn(&[<F as Format>::Block], &[<F as Format>::Act]) -> f32;
        let paths: [(Level, &str, Dot<F>); 2] = [
            (Level::Avx2, "AVX2", row::avx2::dot_rows_order::<F>),
            (Level::Vnni, "AVX-512", row::avx2::dot_rows_order512::<F>),
        ];
        // Rows of 8 blocks (one group of eight sums), 11 (a group and 3 more) and 3 (none).
        for kb in [8, 11, 3] {
            let w = random_blocks::<F>(3 * kb, &[0]);
            for y in [
                activations::<F>(2, kb * F::N),
                extreme_activations::<F>(2, kb * F::N),
            ] {
                for r in 0..3 {
                    let row = &w[r * kb..(r + 1) * kb];
                    for y in y.chunks_exact(kb) {
                        let want = dot_rows_scalar::<F>(row, y).to_bits();
                        for (at, name, dot) in paths {
                            if level() >= at {
                                // SAFETY: the CPU runs `at`'s instructions (checked above).
                                let got = unsafe { dot(row, y) };
                                assert_eq!(
                                    got.to_bits(),
                                    want,
                                    "{:?} {name} {kb} blocks row {r}",
                                    F::DTYPE
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// A staged matrix (rows in 16s) gives each output the bits of the row reference in the
    /// tiles' order, for one token and for many.
    #[test]
    fn a_staged_grid_matrix_sums_as_the_tile_reference() {
        if level() < Level::Avx2 {
            return;
        }
        let (n, k) = (32, 512);
        let (bytes, _) = gguf_matrix(WeightType::IQ2_XS, n, k);
        let m = QMatrix::from_bytes(WeightType::IQ2_XS, n, k, &bytes)
            .unwrap()
            .unwrap();
        let blocks: &[<IQ2XS as Format>::Block] = bytemuck::cast_slice(&bytes);
        let x = seeded(109, (1, 6, k));
        let got = flat(&m.forward(&x).unwrap());
        let xs = flat(&x);
        let mut q = vec![BlockQ8K::zeroed(); 6 * 2];
        for (x, q) in xs.chunks_exact(k).zip(q.chunks_exact_mut(2)) {
            BlockQ8K::quantize(x, q);
        }
        for t in 0..6 {
            for r in 0..n {
                let want =
                    dot_rows_scalar::<IQ2XS>(&blocks[2 * r..2 * r + 2], &q[2 * t..2 * t + 2]);
                assert_eq!(
                    got[t * n + r].to_bits(),
                    want.to_bits(),
                    "token {t} row {r}"
                );
            }
        }
    }

    #[test]
    fn iq4_nl_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<IQ4NL>(&[0]);
    }

    #[test]
    fn iq4_xs_tiles_equal_the_row_reference_bit_for_bit() {
        tiles_equal_the_row_reference::<IQ4XS>(&[0]);
    }

    #[test]
    fn a_stacked_tiled_matrix_computes_each_part_exactly() {
        if level() < Level::Avx2 {
            return;
        }
        let q = |n| {
            QMatrix::from_qtensor(&quantized(WeightType::Q6K, n, 512))
                .unwrap()
                .unwrap()
        };
        let (a, b) = (q(48), q(32));
        assert!(
            a.downcast::<TiledMatrix<Q6K>>().is_some(),
            "rows in 16s make tiles"
        );
        let x = seeded(104, (1, 5, 512));
        let (all, views) = QMatrix::stack(&[&a, &b]).unwrap().expect("one format");
        let all = all.forward(&x).unwrap();
        assert_eq!(
            flat(&all.narrow(2, 0, 48).unwrap()),
            flat(&a.forward(&x).unwrap())
        );
        assert_eq!(
            flat(&all.narrow(2, 48, 32).unwrap()),
            flat(&b.forward(&x).unwrap())
        );
        assert_eq!(
            flat(&views[1].forward(&x).unwrap()),
            flat(&b.forward(&x).unwrap())
        );
        assert_eq!(
            flat(&views[1].rows(&[0, 31]).unwrap()),
            flat(&b.rows(&[0, 31]).unwrap())
        );
    }

    /// Matrices of several formats and shapes (one of rows not in 16s) read by one packer from
    /// their GGUF bytes, and each matrix made on its own from the same bytes.
    fn packed_and_alone(shapes: &[(WeightType, usize, usize)]) -> (Vec<QMatrix>, Vec<QMatrix>) {
        let tensors: Vec<QTensor> = shapes
            .iter()
            .map(|&(dtype, n, k)| quantized(dtype, n, k))
            .collect();
        let mut packer = Packer::new(shapes).unwrap();
        for (t, &(dtype, n, k)) in tensors.iter().zip(shapes) {
            let bytes = t.data().unwrap();
            assert!(packer.read(dtype, n, k, &mut &bytes[..]).unwrap());
        }
        let alone = tensors
            .iter()
            .map(|t| QMatrix::from_qtensor(t).unwrap().unwrap())
            .collect();
        (packer.finish(), alone)
    }

    #[test]
    fn matrices_packed_into_one_store_compute_as_each_made_alone() {
        if level() < Level::Avx2 {
            return;
        }
        let shapes = [
            (WeightType::Q8_0, 64, 256),
            (WeightType::Q5_0, 48, 256),
            (WeightType::Q4K, 32, 512),
            (WeightType::Q6K, 16, 256),
            (WeightType::Q4_0, 24, 256),
            (WeightType::Q5K, 32, 256),
        ];
        let (packed, alone) = packed_and_alone(&shapes);
        for ((p, a), (dtype, n, k)) in packed.iter().zip(&alone).zip(shapes) {
            let x = seeded(107, (1, 3, k));
            let what = format!("{dtype:?} [{n}, {k}]");
            assert_eq!(p.dims(), (n, k), "{what}");
            assert_eq!(
                flat(&p.forward(&x).unwrap()),
                flat(&a.forward(&x).unwrap()),
                "{what}"
            );
            assert_eq!(
                flat(&p.rows(&[0, n as u32 - 1]).unwrap()),
                flat(&a.rows(&[0, n as u32 - 1]).unwrap()),
                "{what} rows"
            );
        }
    }

    #[test]
    fn neighbours_packed_end_to_end_stack_without_a_copy() {
        if level() < Level::Avx2 {
            return;
        }
        let shapes = [
            (WeightType::Q6K, 64, 256),
            (WeightType::Q6K, 16, 256),
            (WeightType::Q6K, 16, 256),
        ];
        let (packed, alone) = packed_and_alone(&shapes);
        let parts: Vec<&QMatrix> = packed.iter().collect();
        let (all, views) = QMatrix::stack(&parts).unwrap().expect("one format");
        fn tiles(m: &QMatrix) -> &TiledMatrix<Q6K> {
            m.downcast().expect("rows in 16s make tiles")
        }
        let (all_t, first) = (tiles(&all), tiles(&packed[0]));
        assert!(all_t.shares_store(first), "stacked over the packed store");
        let x = seeded(108, (1, 2, 256));
        let y = all.forward(&x).unwrap();
        let mut r0 = 0;
        for ((v, a), (_, n, _)) in views.iter().zip(&alone).zip(shapes) {
            let want = flat(&a.forward(&x).unwrap());
            assert_eq!(flat(&y.narrow(2, r0, n).unwrap()), want);
            assert_eq!(flat(&v.forward(&x).unwrap()), want);
            r0 += n;
        }
    }

    #[test]
    fn a_matrix_the_packer_was_not_told_of_is_refused() {
        let t = quantized(WeightType::Q8_0, 32, 256);
        let mut packer = Packer::new(&[(WeightType::Q8_0, 16, 256)]).unwrap();
        let bytes = t.data().unwrap();
        let err = packer.read(WeightType::Q8_0, 32, 256, &mut &bytes[..]);
        let err = err.unwrap_err().to_string();
        assert!(err.contains("not among those planned"), "{err}");
        // Nor one more than it was told of.
        let t = quantized(WeightType::Q8_0, 16, 256);
        let bytes = t.data().unwrap();
        assert!(packer
            .read(WeightType::Q8_0, 16, 256, &mut &bytes[..])
            .unwrap());
        let err = packer.read(WeightType::Q8_0, 16, 256, &mut &bytes[..]);
        assert!(err
            .unwrap_err()
            .to_string()
            .contains("not among those planned"));
    }
}

#[test]
fn a_stacked_matrix_computes_each_part_exactly() {
    let q = |n| {
        QMatrix::from_qtensor(&quantized(WeightType::Q4K, n, 256))
            .unwrap()
            .unwrap()
    };
    let (a, b) = (q(40), q(24));
    let x = seeded(105, (1, 3, 256));
    let (all, views) = QMatrix::stack(&[&a, &b]).unwrap().expect("one format");
    let all = all.forward(&x).unwrap();
    assert_eq!(
        flat(&all.narrow(2, 0, 40).unwrap()),
        flat(&a.forward(&x).unwrap())
    );
    assert_eq!(
        flat(&all.narrow(2, 40, 24).unwrap()),
        flat(&b.forward(&x).unwrap())
    );
    assert_eq!(
        flat(&views[1].forward(&x).unwrap()),
        flat(&b.forward(&x).unwrap())
    );
}

#[test]
fn matrices_of_different_formats_are_not_stacked() {
    let a = QMatrix::from_qtensor(&quantized(WeightType::Q4K, 8, 256))
        .unwrap()
        .unwrap();
    let b = QMatrix::from_qtensor(&quantized(WeightType::Q6K, 8, 256))
        .unwrap()
        .unwrap();
    assert!(QMatrix::stack(&[&a, &b]).unwrap().is_none());
}

#[test]
fn a_token_id_past_the_table_is_an_error_naming_it() {
    let t = QMatrix::from_qtensor(&quantized(WeightType::Q8_0, 8, 64))
        .unwrap()
        .unwrap();
    let e = t.rows(&[8]).unwrap_err().to_string();
    assert!(e.contains("token id 8") && e.contains("8 rows"), "{e}");
}

#[test]
fn the_activation_scale_finds_the_largest_magnitude_and_a_nan_in_any_lane_or_the_tail() {
    // The reference: one fold through every value, as llama.cpp's scalar loop takes it.
    let reference = |x: &[f32]| {
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        (amax / 127.0, if amax != 0.0 { 127.0 / amax } else { 0.0 })
    };
    for len in [32, 35, 7] {
        for at in 0..len {
            for big in [3.5f32, -3.5, 1e-30, f32::INFINITY] {
                let mut x: Vec<f32> = (0..len).map(|i| (i as f32 * 0.77).sin()).collect();
                x[at] = big;
                let (d, id) = q8_scale(&x);
                let (rd, rid) = reference(&x);
                assert_eq!((d.to_bits(), id.to_bits()), (rd.to_bits(), rid.to_bits()));
            }
            let mut x = vec![0.25f32; len];
            x[at] = f32::NAN;
            let (d, id) = q8_scale(&x);
            assert!(d.is_nan() && id == 0.0, "NaN at {at} of {len}");
        }
    }
    assert_eq!(q8_scale(&[0.0; 32]), (0.0, 0.0));
}

#[test]
fn the_largest_magnitude_is_the_first_one_a_single_pass_finds() {
    // The reference: llama.cpp's `quantize_row_q8_K_ref` loop.
    let reference = |x: &[f32]| {
        let (mut max, mut amax) = (0f32, 0f32);
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        (max, amax)
    };
    for len in [256, 261, 5, 0] {
        for at in 0..len {
            // Ties of opposite sign before and after `at`, and in another lane.
            for (big, twin) in [
                (3.5f32, -3.5f32),
                (-2.0, 2.0),
                (1e-30, -1e-30),
                (f32::INFINITY, 1.0),
            ] {
                let mut x: Vec<f32> = (0..len).map(|i| (i as f32 * 0.77).sin()).collect();
                x[at] = big;
                x[(at * 7 + 3) % len] = twin;
                let (m, a) = largest_magnitude(&x).unwrap();
                let (rm, ra) = reference(&x);
                assert_eq!(
                    (m.to_bits(), a.to_bits()),
                    (rm.to_bits(), ra.to_bits()),
                    "{len} {at}"
                );
            }
            let mut x = vec![0.25f32; len];
            x[at] = f32::NAN;
            assert_eq!(largest_magnitude(&x), None, "NaN at {at} of {len}");
        }
    }
    assert_eq!(largest_magnitude(&[0.0, -0.0, 0.0]), Some((0.0, 0.0)));
}

#[test]
fn activation_rounding_is_round_ties_even_clamped_with_nan_as_zero() {
    let reference = |v: f32| v.round_ties_even().clamp(-127.0, 127.0) as i8;
    let mut vs: Vec<f32> = (-300_000..=300_000).map(|i| i as f32 * 1e-3).collect(); // ±300
    vs.extend((-300..=300).map(|i| i as f32 + 0.5)); // every tie
    vs.extend([
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        -f32::MAX,
        1e-40,
        -0.0,
    ]);
    for v in vs {
        assert_eq!(round_i8(v), reference(v), "{v}");
    }
    assert_eq!(round_i8(f32::NAN), 0);
}

#[test]
fn q8_0_and_q8_1_activations_are_llama_cpps_quants_ties_to_even() {
    // max 127 makes the multiplier 1: x.5 values are exact ties.
    let mut x = [0f32; 32];
    x[..6].copy_from_slice(&[127.0, 0.5, 1.5, 2.5, -2.5, -3.5]);
    let want = [127i8, 0, 2, 2, -2, -4];
    let mut q0 = [BlockQ8_0::zeroed()];
    BlockQ8_0::quantize(&x, &mut q0);
    assert_eq!(&q0[0].qs[..6], &want);
    assert_eq!(q0[0].d, 1.0);
    let mut q1 = [BlockQ8_1::zeroed()];
    BlockQ8_1::quantize(&x, &mut q1);
    assert_eq!(&q1[0].qs[..6], &want);
    // s = d·Σq = 127 + 0 + 2 + 2 − 2 − 4.
    assert_eq!(q1[0].s, 125.0);
}

#[test]
fn q8_1_sum_is_rounded_to_f16_once_from_the_unrounded_scale() {
    // max 100: d = 100/127 is not an f16; every quant is 127 or 0, so Σq = 32·127 and
    // s = f16(d·Σq) = f16(3200), where f16(d)·Σq would be 3200·(1 + ε).
    let x = [100f32; 32];
    let mut q1 = [BlockQ8_1::zeroed()];
    BlockQ8_1::quantize(&x, &mut q1);
    assert!(q1[0].qs.iter().all(|&q| q == 127));
    let d = 100f32 / 127.0;
    assert_eq!(q1[0].s, f16::from_f32(d * (32 * 127) as f32).to_f32());
    assert_ne!(
        f16::from_f32(d).to_f32() * (32 * 127) as f32,
        d * (32 * 127) as f32
    );
}

#[test]
fn q8_k_activations_map_the_largest_magnitude_to_minus_127_and_keep_block_sums() {
    let mut x = vec![0.5f32; 256];
    x[7] = -2.0;
    let mut y = [BlockQ8K::zeroed()];
    BlockQ8K::quantize(&x, &mut y);
    assert_eq!(y[0].qs[7], -127);
    assert_eq!(y[0].d, 2.0 / 127.0);
    assert_eq!(y[0].qs[0], 32); // 0.5 · 63.5 = 31.75
    assert_eq!(y[0].bsums[0], 15 * 32 - 127);
}

/// The tile kernel (1 and 4 tokens) against the per-row reference of the tiled order, bit for
/// bit, on blocks of random bytes; each tile row dequantizes to its block's values.
#[cfg(target_arch = "x86_64")]
fn tiles_equal_the_row_reference<F: tiled::TileKernels>(halves: &[usize]) {
    for level in [Level::Avx2, Level::Vnni] {
        if level <= super::level() {
            tiles_at_level_equal_the_row_reference::<F>(level, halves);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn tiles_at_level_equal_the_row_reference<F: tiled::TileKernels>(level: Level, halves: &[usize]) {
    let (rows, kb) = (32, 4);
    let w = random_blocks::<F>(rows * kb, halves);
    let m = TiledMatrix::<F>::from_blocks(rows, kb * F::N, &w).unwrap();
    let mut a = vec![0f32; kb * F::N];
    let mut b = vec![0f32; F::N];
    for r in 0..rows {
        m.dequantize_row(r, &mut a);
        for (blk, chunk) in w[r * kb..(r + 1) * kb].iter().zip(a.chunks_exact(F::N)) {
            F::dequantize(blk, &mut b);
            assert_eq!(chunk, &b[..], "row {r} dequantized");
        }
    }
    let xs: Vec<f32> = {
        let mut r = rng();
        (0..7 * kb * F::N)
            .map(|i| {
                // Even tokens spread; odd ones at the extremes (every quant ±127).
                if (i / (kb * F::N)) % 2 == 0 {
                    r.random_range(-3f32..3.0)
                } else if r.random() {
                    1.0
                } else {
                    -1.0
                }
            })
            .collect()
    };
    let mut q = vec![F::Act::zeroed(); 7 * kb];
    for (x, q) in xs.chunks_exact(kb * F::N).zip(q.chunks_exact_mut(kb)) {
        F::Act::quantize(x, q);
    }
    // 5, 6 and 7 tokens: a call of four, then one of 1, 2 or 3.
    for n in [5, 6, 7] {
        let mut out = vec![0f32; n * rows];
        m.matmul_at(level, &xs[..n * kb * F::N], n, &mut out);
        for t in 0..n {
            for r in 0..rows {
                let reference =
                    dot_rows_scalar::<F>(&w[r * kb..(r + 1) * kb], &q[t * kb..(t + 1) * kb]);
                assert_eq!(
                    out[t * rows + r].to_bits(),
                    reference.to_bits(),
                    "{level:?} token {t} of {n}, row {r}"
                );
            }
        }
    }
}

/// Not a test: `cargo test --release --lib quant::tests::speed -- --ignored --nocapture` prints
/// our matmul's time against candle's QMatMul per format (decode and a 128-token prefill);
/// KVCHAT_SPEED_ONLY=Q8_0 picks one format, KVCHAT_SPEED_M one token count.
#[test]
#[ignore]
fn speed() {
    let only = std::env::var("KVCHAT_SPEED_ONLY").ok();
    for dtype in FORMATS {
        if only.as_ref().is_some_and(|o| *o != format!("{dtype:?}")) {
            continue;
        }
        // KVCHAT_SPEED_SHAPE=ROWSxCOLS (default 2048x2048; Gemma 3's output head: 262144x640).
        let (rows, cols) = std::env::var("KVCHAT_SPEED_SHAPE")
            .ok()
            .and_then(|s| {
                let (r, c) = s.split_once('x')?;
                Some((r.parse().ok()?, c.parse().ok()?))
            })
            .unwrap_or((2048usize, 2048usize));
        let (bytes, _) = gguf_matrix(dtype, rows, cols);
        // Packing at load (best of 3; each into fresh pages, as a load does).
        let pack_ms = (0..3)
            .map(|_| {
                let t = std::time::Instant::now();
                drop(QMatrix::from_bytes(dtype, rows, cols, &bytes).unwrap());
                t.elapsed().as_secs_f64() * 1e3
            })
            .fold(f64::INFINITY, f64::min);
        println!(
            "{dtype:?} [{rows}, {cols}]: packed in {pack_ms:.1} ms ({:.2} GB/s)",
            bytes.len() as f64 / pack_ms / 1e6
        );
        let ours = QMatrix::from_bytes(dtype, rows, cols, &bytes)
            .unwrap()
            .unwrap();
        // candle's QMatMul where candle runs the type (not the i-quants).
        let candle = dtype
            .candle()
            .map(|_| QMatMul::from_qtensor(quantized(dtype, rows, cols)).unwrap());
        // KVCHAT_SPEED_M=1 (or 128): that token count only.
        let ms: Vec<usize> = match std::env::var("KVCHAT_SPEED_M")
            .ok()
            .and_then(|m| m.parse().ok())
        {
            Some(m) => vec![m],
            None => vec![1, 128],
        };
        for m in ms {
            let x = seeded(106, (1, m, cols));
            let reps = if m == 1 { 200 } else { 4 };
            let time = |f: &dyn Fn()| {
                f();
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    f();
                }
                t.elapsed().as_secs_f64() * 1e3 / reps as f64
            };
            let a = time(&|| drop(ours.forward(&x).unwrap()));
            match &candle {
                Some(c) => {
                    let b = time(&|| drop(c.forward(&x).unwrap()));
                    println!(
                        "{dtype:?} m={m}: ours {a:.3} ms, candle {b:.3} ms, ratio {:.2}",
                        b / a
                    );
                }
                None => println!("{dtype:?} m={m}: ours {a:.3} ms"),
            }
        }
    }
}

/// Every row of the weight-type table reaches every piece: its name in the GGUF reader's
/// messages, a matrix this driver builds from candle's blocks (in rows of 16, as tiles where
/// declared and AVX2 runs; in 17 rows, per row), and a matmul that is the dequantized matrix's
/// to the activations' rounding. A row that lacks one fails here.
#[test]
fn every_weight_type_in_the_table_runs_in_both_layouts() {
    for (id, name, dtype) in WEIGHT_TYPES {
        assert_eq!(
            crate::model::gguf_types::type_name(id),
            format!("type {name}")
        );
        assert!(FORMATS.contains(&dtype), "{name}");
        for n in [48, 17] {
            let k = 512;
            let (bytes, deq) = gguf_matrix(dtype, n, k);
            let m = QMatrix::from_bytes(dtype, n, k, &bytes)
                .unwrap()
                .unwrap_or_else(|| panic!("{name}: no matrix"));
            assert_eq!((m.dtype(), m.dims()), (dtype, (n, k)), "{name}");
            let tiled =
                tiled_format!(dtype, |F| m.downcast::<TiledMatrix<F>>().is_some(), else false);
            assert_eq!(
                tiled,
                n == 48 && level() >= Level::Avx2 && tiled_format!(dtype, |_F| true, else false),
                "{name} in {n} rows"
            );
            // Against the dequantized matrix in f32: the only difference is the activations'
            // 8-bit quantization (measured 4e-3 of the largest output over 512 columns; candle's
            // QMatMul is no closer: its Q8_0 path is off by 7e-3).
            let x = seeded(7, (1, 1, k));
            let ours = flat(&m.forward(&x).unwrap());
            let w = Tensor::from_vec(deq, (n, k), &Device::Cpu).unwrap();
            let exact = flat(&x.broadcast_matmul(&w.t().unwrap()).unwrap());
            let (diff, scale) = max_diff(&ours, &exact);
            assert!(
                diff <= 1e-2 * scale,
                "{name} in {n} rows: {diff} of {scale}"
            );
        }
    }
}

/// The i-quants: the SIMD paths against the scalar reference, the scalar sums against the
/// dequantized values, rows against the format's dequantization, prefill against decode, and the
/// matmul against f32 arithmetic on the dequantized matrix (candle has no i-quants to compare with).
macro_rules! iquant_tests {
    ($name:ident, $f:ty, act = $act:expr) => {
        mod $name {
            use super::*;

            /// Where the block's f16 `d` lies (IQ1_M and MXFP4 have none: `random_blocks` makes
            /// their scales).
            fn halves() -> &'static [usize] {
                if [WeightType::IQ1_M, WeightType::MXFP4].contains(&<$f as Format>::DTYPE) {
                    &[]
                } else {
                    &[0]
                }
            }

            #[test]
            fn avx2_and_avx512_dots_equal_the_scalar_reference_bit_for_bit() {
                simd_equals_scalar::<$f>(halves());
            }

            #[test]
            fn scalar_dot_equals_the_dot_of_the_dequantized_values() {
                scalar_dot_is_the_dequantized_dot::<$f>(halves(), $act);
            }

            #[test]
            fn embedding_rows_are_the_formats_dequantization_exactly() {
                let k = 2 * <$f as Format>::N;
                let (bytes, deq) = gguf_matrix(<$f as Format>::DTYPE, 12, k);
                let m = QMatrix::from_bytes(<$f as Format>::DTYPE, 12, k, &bytes)
                    .unwrap()
                    .unwrap();
                let got = flat(&m.rows(&[3, 0, 11]).unwrap());
                for (i, r) in [3usize, 0, 11].into_iter().enumerate() {
                    assert_eq!(
                        &got[i * k..(i + 1) * k],
                        &deq[r * k..(r + 1) * k],
                        "row {r}"
                    );
                }
            }

            #[test]
            fn each_prefill_row_has_the_bits_of_that_token_decoded_alone() {
                prefill_rows_have_the_bits_of_decode::<$f>(40);
                prefill_rows_have_the_bits_of_decode::<$f>(48);
            }
        }
    };
}

iquant_tests!(iq4_nl, IQ4NL, act = q8_0);
iquant_tests!(iq4_xs, IQ4XS, act = q8_k);
iquant_tests!(iq2_xxs, IQ2XXS, act = q8_k);
iquant_tests!(iq2_xs, IQ2XS, act = q8_k);
iquant_tests!(iq2_s, IQ2S, act = q8_k);
iquant_tests!(iq3_xxs, IQ3XXS, act = q8_k);
iquant_tests!(iq3_s, IQ3S, act = q8_k);
iquant_tests!(iq1_s, IQ1S, act = q8_k);
iquant_tests!(iq1_m, IQ1M, act = q8_k);
iquant_tests!(mxfp4, MXFP4, act = q8_0);

/// MXFP4 dequantizes a block as gguf-py's `quants.dequantize` does: bytes `(37·i + 11) mod 256`
/// with e = 120 (a scale of 2^-8) give these 32 values × 256; e = 1 gives subnormal scales
/// (6 · 2^-127 has bits 0x01400000). From (gguf-py of the vendored llama.cpp 0.3.36):
///   PYTHONPATH=…/vendor/llama.cpp/gguf-py python3 -c 'import numpy as np, gguf; from gguf import
///   quants; t=gguf.GGMLQuantizationType.MXFP4; bs,ts=gguf.GGML_QUANT_SIZES[t]; b=np.array(
///   [(i*37+11)%256 for i in range(ts)],np.uint8); b[0]=120; v=quants.dequantize(b.reshape(1,ts),
///   t).reshape(-1); print([float(x)*256 for x in v])'
#[test]
fn an_mxfp4_block_dequantizes_as_gguf_py_does() {
    let mut bytes: Vec<u8> = (0..17).map(|i| ((i * 37 + 11) % 256) as u8).collect();
    bytes[0] = 120;
    let mut block: iquants::BlockMXFP4 = bytemuck::pod_read_unaligned(&bytes);
    let mut out = [0f32; 32];
    <MXFP4 as Format>::dequantize(&block, &mut out);
    let want = [
        0.0, 6.0, -2.0, -12.0, 4.0, -1.0, -8.0, 3.0, 0.0, -6.0, 2.0, 12.0, -4.0, 1.0, 8.0, -3.0,
        3.0, 6.0, 12.0, -1.0, -4.0, -8.0, 0.0, 3.0, 6.0, 12.0, -2.0, -4.0, -8.0, 1.0, 3.0, 6.0,
    ];
    assert_eq!(out.map(|v| v * 256.0), want);
    block.e = 1;
    <MXFP4 as Format>::dequantize(&block, &mut out);
    assert_eq!(out[1].to_bits(), 0x0140_0000);
    assert_eq!(iquants::e8m0_half(0).to_bits(), 0x0020_0000);
    assert_eq!(iquants::e8m0_half(255), 2f32.powi(127));
}

/// IQ4_NL as the format defines it: value j of a block is d · KVALUES[nibble j], low nibbles
/// first.
#[test]
fn an_iq4_nl_block_dequantizes_to_its_scale_times_the_table() {
    let mut b = iquants::BlockIQ4NL::zeroed();
    b.d = f16::from_f32(0.5);
    for j in 0..16u8 {
        b.qs[j as usize] = j | ((15 - j) << 4);
    }
    let mut out = [0f32; 32];
    <IQ4NL as Format>::dequantize(&b, &mut out);
    let kv = iquants::KVALUES;
    for j in 0..16 {
        assert_eq!(out[j], 0.5 * kv[j] as f32, "value {j}");
        assert_eq!(out[j + 16], 0.5 * kv[15 - j] as f32, "value {}", j + 16);
    }
    assert_eq!((out[0], out[15]), (-63.5, 56.5));
}

/// IQ4_XS as the format defines it: sub-block ib's 6-bit scale is nibble ib of `scales_l` with
/// bits 2ib..2ib+2 of `scales_h` above it, less 32; value j of the sub-block is
/// d · scale · KVALUES[nibble j of qs[16ib..]].
#[test]
fn an_iq4_xs_block_dequantizes_to_its_scale_times_sub_block_scale_times_the_table() {
    let stored: [u8; 8] = [0, 63, 32, 33, 17, 48, 5, 40];
    let mut b = iquants::BlockIQ4XS::zeroed();
    b.d = f16::from_f32(0.25);
    for (ib, &s) in stored.iter().enumerate() {
        b.scales_l[ib / 2] |= (s & 15) << (4 * (ib % 2));
        b.scales_h |= ((s >> 4) as u16) << (2 * ib);
    }
    for (i, q) in b.qs.iter_mut().enumerate() {
        *q = (i % 16) as u8 | (((i * 7) % 16) as u8) << 4;
    }
    let mut out = [0f32; 256];
    <IQ4XS as Format>::dequantize(&b, &mut out);
    let kv = iquants::KVALUES;
    for (ib, &s) in stored.iter().enumerate() {
        assert_eq!(iquants::scale_xs(&b, ib), s as i32 - 32, "scale {ib}");
        let dl = 0.25 * (s as f32 - 32.0);
        for j in 0..16 {
            let q = b.qs[16 * ib + j];
            assert_eq!(out[32 * ib + j], dl * kv[(q & 15) as usize] as f32);
            assert_eq!(out[32 * ib + 16 + j], dl * kv[(q >> 4) as usize] as f32);
        }
    }
    assert_eq!(out[32], 0.25 * 31.0 * -127.0);
}

/// Each i-quant dequantizes a block as gguf-py's `quants.dequantize` does (the format's
/// independent reference implementation): block bytes `(37·i + 11) mod 256` with d = 0.5 at bytes
/// 0..2 (IQ1_M keeps its bytes: its d is spread over the scales); the values at every 17th
/// element and the sum of all, from (gguf-py of the vendored llama.cpp 0.3.36):
///   PYTHONPATH=…/vendor/llama.cpp/gguf-py python3 -c 'import numpy as np, gguf; from gguf import
///   quants; t=gguf.GGMLQuantizationType.IQ2_XXS; bs,ts=gguf.GGML_QUANT_SIZES[t];
///   b=np.array([(i*37+11)%256 for i in range(ts)],np.uint8); b[0:2]=np.frombuffer(
///   np.float16(0.5).tobytes(),np.uint8); v=quants.dequantize(b.reshape(1,ts),t).reshape(-1);
///   print(list(v[::17]), v.astype(np.float64).sum())'
#[test]
fn every_i_quant_dequantizes_a_block_as_gguf_py_does() {
    fn check<F: Format>(every17: &[f32], sum: f64) {
        let size = std::mem::size_of::<F::Block>();
        let mut bytes: Vec<u8> = (0..size).map(|i| ((i * 37 + 11) % 256) as u8).collect();
        if F::DTYPE != WeightType::IQ1_M {
            bytes[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        }
        let block: F::Block = bytemuck::pod_read_unaligned(&bytes);
        let mut out = vec![0f32; F::N];
        F::dequantize(&block, &mut out);
        let got: Vec<f32> = out.iter().step_by(17).copied().collect();
        assert_eq!(got, every17, "{}", F::DTYPE);
        assert_eq!(
            out.iter().map(|&v| v as f64).sum::<f64>(),
            sum,
            "{}",
            F::DTYPE
        );
    }
    check::<IQ2XXS>(
        &[
            -29.5625, 29.5625, 8.5, -26.5625, -10.5, 10.5, -72.5625, 13.5, -15.5, -48.4375,
            -7.8125, 7.8125, -14.0625, 4.5, -7.5, -40.3125,
        ],
        381.875,
    );
    check::<IQ2XS>(
        &[
            -5.5, -9.5, 10.5, -35.9375, 48.4375, -13.5, -24.1875, -0.5, 29.6875, 7.8125, -14.5,
            24.1875, -3.5, -7.5, -26.5625, -9.5,
        ],
        745.25,
    );
    check::<IQ2S>(
        &[
            -72.5625, -61.8125, 2.5, 14.5, -23.4375, -2.6875, 12.5, -2.5, 1.5, 29.5625, -20.3125,
            -7.5, -35.9375, 29.6875, 1.5625, 39.0625,
        ],
        -400.3125,
    );
    check::<IQ3XXS>(
        &[
            -6.5, -0.5, 66.5, -9.5, -32.5, 2.5, -37.5, -62.5, -38.5, 27.5, -14.5, 224.75, 67.5,
            -37.5, 1.5, -7.5,
        ],
        -342.0,
    );
    check::<IQ3S>(
        &[
            -40.5, -121.5, 5.5, -27.5, 12.5, -2.5, -59.5, -25.5, 37.5, 67.5, -31.5, 157.5, -62.5,
            -187.5, -187.5, 112.5,
        ],
        728.0,
    );
    check::<IQ1S>(
        &[
            -1.3125, -1.3125, 7.3125, -5.6875, -2.8125, -0.3125, -8.4375, -0.9375, 0.5625, 5.0625,
            -0.0625, -0.0625, 4.8125, 4.8125, 2.8125, -2.1875,
        ],
        10.0,
    );
    check::<IQ1M>(
        &[
            52920.0, -113400.0, -52920.0, 7560.0, 83160.0, -68040.0, -158760.0, -582120.0,
            113400.0, 204120.0, 264600.0, 264600.0, 158760.0, 476280.0, 476280.0, 113400.0,
        ],
        -2479680.0,
    );
    check::<IQ4NL>(&[-17.5, -5.0], -128.5);
    check::<IQ4XS>(
        &[
            32.5, 17.5, -241.5, -395.5, 60.0, -6.0, 208.0, 166.0, 171.0, 238.5, -245.0, -245.0,
            1695.0, 1695.0, -104.0, -8.0,
        ],
        -5502.5,
    );
}

/// A NaN in a token's input makes that token's outputs NaN in every type and layout (a damaged
/// weight upstream must reach the logits, where sampling refuses it), and leaves the other
/// tokens' outputs alone.
#[test]
fn a_nan_input_gives_that_tokens_outputs_nan_in_every_type() {
    for (_, name, dtype) in WEIGHT_TYPES {
        for (n, m) in [(48, 2), (48, 6), (17, 2)] {
            let k = 512;
            let (bytes, _) = gguf_matrix(dtype, n, k);
            let w = QMatrix::from_bytes(dtype, n, k, &bytes).unwrap().unwrap();
            let mut x = flat(&seeded(7, (1, m, k)));
            x[5] = f32::NAN;
            let x = Tensor::from_vec(x, (1, m, k), &Device::Cpu).unwrap();
            let out = flat(&w.forward(&x).unwrap());
            assert!(
                out[..n].iter().all(|v| v.is_nan()),
                "{name} {n}×{m}: token 0"
            );
            assert!(
                out[n..].iter().all(|v| v.is_finite()),
                "{name} {n}×{m}: the others"
            );
        }
    }
}

/// The signed grids' staging in registers writes the tile the scalar unpacking writes, byte
/// for byte (values, scales, d and bias), on blocks of random bytes in every row of a tile.
#[cfg(target_arch = "x86_64")]
#[test]
fn signed_grid_staging_in_registers_equals_the_scalar_staging() {
    use super::iqgrid::{stage_scalar, Stage};
    use super::tiled::{TileGrid, TR};
    fn check<F: Stage + Format<Block = <F as super::iqgrid::Grid>::Block>>() {
        if level() < Level::Avx2 {
            return;
        }
        let blocks = random_blocks::<F>(TR, &[0]);
        let (mut fast, mut slow) = (TileGrid::zeroed(), TileGrid::zeroed());
        for (r, x) in blocks.iter().enumerate() {
            F::stage(x, r, &mut fast);
            stage_scalar::<F>(x, r, &mut slow);
        }
        assert_eq!(
            bytemuck::bytes_of(&fast),
            bytemuck::bytes_of(&slow),
            "{:?}",
            <F as Format>::DTYPE
        );
    }
    check::<IQ2XXS>();
    check::<IQ2XS>();
    check::<IQ2S>();
    check::<IQ3XXS>();
    check::<IQ3S>();
}
