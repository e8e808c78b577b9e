//! The Q4_1 × Q8_1 dot products in AVX2 + FMA, summed in exactly `vec_dot_scalar`'s order (tested
//! bit for bit against it in `q4_1.rs`). Callers check AVX2 and FMA at run time first.

use super::q4_1::{BlockQ4_1, BlockQ8_1};

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
