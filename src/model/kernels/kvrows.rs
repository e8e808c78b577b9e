//! Row formats of the KV cache: how one position of one KV head (`head_dim` values) is stored, and
//! how attention widens it back to f32. One entry per format, as ggml's type-traits table: the cache
//! encodes with [`Codec::encode`], the attention kernel decodes with [`Codec::decoder`] (the fastest
//! path this CPU has, chosen once) into a row of scratch, then does all its arithmetic in f32.
//! Decoding is exact (f16/bf16 widen, `q·d` is one rounding), so every SIMD decoder gives the scalar
//! one's bits.
//!
//! Quantized rows (`Q8`, `Q4`): `head_dim` is cut into groups of [`QK`] values, each with one f16
//! scale `d`, symmetric: Q8 `x ≈ q·d`, q ∈ [-127, 127]; Q4 `x ≈ (q − 8)·d`, q ∈ [0, 15] (ggml's q4_0).
//! Row layout: the quants first (`hd` bytes for Q8; `hd / 2` for Q4, group g's byte j holding value
//! `32g + j` in its low nibble and `32g + j + 16` in its high one), then the `hd / QK` scales, f16
//! little-endian. Q8 is 8.5 bits a value, Q4 4.5.

use half::{bf16, f16};

/// Values per quantization group (one f16 scale each).
pub const QK: usize = 32;

/// Widens a stored row into f32: the row itself for f32, else written into `buf` (`hd` long).
pub type Decoder<E> = for<'b> fn(&'b [E], &'b mut [f32]) -> &'b [f32];

/// A row format.
pub trait Codec: Send + Sync + 'static {
    /// The element a row is made of.
    type E: bytemuck::Pod + Default + Send + Sync;
    /// Elements of `E` in a row of `hd` values.
    fn row_len(hd: usize) -> usize;
    /// Stores `x` (`hd` values) as `out` (`row_len(hd)` elements).
    fn encode(x: &[f32], out: &mut [Self::E]);
    /// The portable decoder, the reference for the others.
    fn decode_scalar<'b>(row: &'b [Self::E], buf: &'b mut [f32]) -> &'b [f32];
    /// The fastest decoder this CPU runs.
    fn decoder() -> Decoder<Self::E> {
        Self::decode_scalar
    }
    /// Whether stored rows (their bytes, little-endian) hold only finite values, where the bytes
    /// tell without decoding (float formats); None where they do not (quantized rows).
    fn all_finite(_raw: &[u8]) -> Option<bool> {
        None
    }
}

/// Whether any `W`-byte little-endian word of `raw` has all of `exponent`'s bits set (infinity
/// or NaN in an IEEE format whose exponent field is `exponent`).
fn any_exponent_full<const W: usize>(raw: &[u8], exponent: u32) -> bool {
    raw.chunks_exact(W).any(|b| {
        let mut w = [0u8; 4];
        w[..W].copy_from_slice(b);
        u32::from_le_bytes(w) & exponent == exponent
    })
}

pub struct F32;
pub struct F16;
pub struct Bf16;
pub struct Q8;
pub struct Q4;

impl Codec for F32 {
    type E = f32;
    fn row_len(hd: usize) -> usize {
        hd
    }
    fn encode(x: &[f32], out: &mut [f32]) {
        out.copy_from_slice(x);
    }
    fn decode_scalar<'b>(row: &'b [f32], _buf: &'b mut [f32]) -> &'b [f32] {
        row
    }
    fn all_finite(raw: &[u8]) -> Option<bool> {
        Some(!any_exponent_full::<4>(raw, 0x7f80_0000))
    }
}

impl Codec for F16 {
    type E = f16;
    fn row_len(hd: usize) -> usize {
        hd
    }
    fn encode(x: &[f32], out: &mut [f16]) {
        for (o, x) in out.iter_mut().zip(x) {
            *o = f16::from_f32(*x);
        }
    }
    fn decode_scalar<'b>(row: &'b [f16], buf: &'b mut [f32]) -> &'b [f32] {
        for (b, x) in buf.iter_mut().zip(row) {
            *b = x.to_f32();
        }
        &buf[..row.len()]
    }
    fn decoder() -> Decoder<f16> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            return simd::f16_row;
        }
        Self::decode_scalar
    }
    fn all_finite(raw: &[u8]) -> Option<bool> {
        Some(!any_exponent_full::<2>(raw, 0x7c00))
    }
}

impl Codec for Bf16 {
    type E = bf16;
    fn row_len(hd: usize) -> usize {
        hd
    }
    fn encode(x: &[f32], out: &mut [bf16]) {
        for (o, x) in out.iter_mut().zip(x) {
            *o = bf16::from_f32(*x);
        }
    }
    fn decode_scalar<'b>(row: &'b [bf16], buf: &'b mut [f32]) -> &'b [f32] {
        for (b, x) in buf.iter_mut().zip(row) {
            *b = x.to_f32();
        }
        &buf[..row.len()]
    }
    fn decoder() -> Decoder<bf16> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return simd::bf16_row;
        }
        Self::decode_scalar
    }
    fn all_finite(raw: &[u8]) -> Option<bool> {
        Some(!any_exponent_full::<2>(raw, 0x7f80))
    }
}

/// The f16 scale of group `g` of a quantized row whose scales start at byte `at`.
#[inline(always)]
fn scale(row: &[u8], at: usize, g: usize) -> f32 {
    f16::from_le_bytes([row[at + 2 * g], row[at + 2 * g + 1]]).to_f32()
}

impl Codec for Q8 {
    type E = u8;
    fn row_len(hd: usize) -> usize {
        hd + 2 * hd / QK
    }
    fn encode(x: &[f32], out: &mut [u8]) {
        let hd = x.len();
        let (qs, ds) = out.split_at_mut(hd);
        for (g, xs) in x.chunks_exact(QK).enumerate() {
            let amax = xs.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = f16::from_f32(amax / 127.0);
            let df = d.to_f32();
            for (q, x) in qs[g * QK..(g + 1) * QK].iter_mut().zip(xs) {
                let v = if df > 0.0 { (x / df).round() } else { 0.0 };
                *q = v.clamp(-127.0, 127.0) as i8 as u8;
            }
            ds[2 * g..2 * g + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    fn decode_scalar<'b>(row: &'b [u8], buf: &'b mut [f32]) -> &'b [f32] {
        let hd = row.len() * QK / (QK + 2);
        for (g, out) in buf[..hd].chunks_exact_mut(QK).enumerate() {
            let d = scale(row, hd, g);
            for (o, q) in out.iter_mut().zip(&row[g * QK..(g + 1) * QK]) {
                *o = (*q as i8) as f32 * d;
            }
        }
        &buf[..hd]
    }
    fn decoder() -> Decoder<u8> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return simd::q8_row;
        }
        Self::decode_scalar
    }
}

impl Codec for Q4 {
    type E = u8;
    fn row_len(hd: usize) -> usize {
        hd / 2 + 2 * hd / QK
    }
    fn encode(x: &[f32], out: &mut [u8]) {
        let hd = x.len();
        let (qs, ds) = out.split_at_mut(hd / 2);
        for (g, xs) in x.chunks_exact(QK).enumerate() {
            // The value of largest magnitude maps to −8 exactly (ggml's q4_0).
            let m = xs
                .iter()
                .fold(0f32, |m, &x| if x.abs() > m.abs() { x } else { m });
            let d = f16::from_f32(m / -8.0);
            let df = d.to_f32();
            let q = |x: f32| -> u8 {
                let v = if df != 0.0 { (x / df).round() } else { 0.0 };
                (v.clamp(-8.0, 7.0) + 8.0) as u8
            };
            for j in 0..QK / 2 {
                qs[g * QK / 2 + j] = q(xs[j]) | (q(xs[j + QK / 2]) << 4);
            }
            ds[2 * g..2 * g + 2].copy_from_slice(&d.to_le_bytes());
        }
    }
    fn decode_scalar<'b>(row: &'b [u8], buf: &'b mut [f32]) -> &'b [f32] {
        let hd = row.len() * QK / (QK / 2 + 2);
        for (g, out) in buf[..hd].chunks_exact_mut(QK).enumerate() {
            let d = scale(row, hd / 2, g);
            for (j, b) in row[g * QK / 2..(g + 1) * QK / 2].iter().enumerate() {
                out[j] = ((b & 0x0f) as i32 - 8) as f32 * d;
                out[j + QK / 2] = ((b >> 4) as i32 - 8) as f32 * d;
            }
        }
        &buf[..hd]
    }
    fn decoder() -> Decoder<u8> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") {
            return simd::q4_row;
        }
        Self::decode_scalar
    }
}

/// The x86 decoders. Each is a safe `Decoder` that `Codec::decoder` hands out only after checking the
/// CPU features its `target_feature` body needs; the unsafe blocks rely on that check and on the
/// bounds asserted at the top of each function (every load reads inside `row`, every store inside
/// `buf`).
#[cfg(target_arch = "x86_64")]
mod simd {
    use super::QK;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    pub fn f16_row<'b>(row: &'b [f16], buf: &'b mut [f32]) -> &'b [f32] {
        let n = row.len();
        assert!(buf.len() >= n);
        #[target_feature(enable = "avx2,f16c")]
        unsafe fn go(row: &[f16], buf: &mut [f32]) {
            for i in (0..row.len() / 8 * 8).step_by(8) {
                let h = _mm_loadu_si128(row.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(buf.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
        // SAFETY: see the module's contract (avx2+f16c checked; whole 8s within both).
        unsafe { go(row, buf) };
        for i in n / 8 * 8..n {
            buf[i] = row[i].to_f32();
        }
        &buf[..n]
    }

    pub fn bf16_row<'b>(row: &'b [bf16], buf: &'b mut [f32]) -> &'b [f32] {
        let n = row.len();
        assert!(buf.len() >= n);
        #[target_feature(enable = "avx2")]
        unsafe fn go(row: &[bf16], buf: &mut [f32]) {
            for i in (0..row.len() / 8 * 8).step_by(8) {
                let h = _mm_loadu_si128(row.as_ptr().add(i) as *const __m128i);
                let w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
                _mm256_storeu_ps(buf.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
            }
        }
        // SAFETY: see the module's contract (avx2 checked; whole 8s within both).
        unsafe { go(row, buf) };
        for i in n / 8 * 8..n {
            buf[i] = row[i].to_f32();
        }
        &buf[..n]
    }

    pub fn q8_row<'b>(row: &'b [u8], buf: &'b mut [f32]) -> &'b [f32] {
        let hd = row.len() * QK / (QK + 2);
        assert!(hd.is_multiple_of(QK) && row.len() == hd + 2 * hd / QK && buf.len() >= hd);
        #[target_feature(enable = "avx2")]
        unsafe fn go(row: &[u8], buf: &mut [f32], hd: usize) {
            for g in 0..hd / QK {
                let d = _mm256_set1_ps(super::scale(row, hd, g));
                for i in 0..4 {
                    let at = g * QK + 8 * i;
                    let q = _mm_loadl_epi64(row.as_ptr().add(at) as *const __m128i);
                    let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                    _mm256_storeu_ps(buf.as_mut_ptr().add(at), _mm256_mul_ps(x, d));
                }
            }
        }
        // SAFETY: see the module's contract (avx2 checked; groups of 32 inside row and buf).
        unsafe { go(row, buf, hd) };
        &buf[..hd]
    }

    pub fn q4_row<'b>(row: &'b [u8], buf: &'b mut [f32]) -> &'b [f32] {
        let hd = row.len() * QK / (QK / 2 + 2);
        assert!(hd.is_multiple_of(QK) && row.len() == hd / 2 + 2 * hd / QK && buf.len() >= hd);
        #[target_feature(enable = "avx2")]
        unsafe fn go(row: &[u8], buf: &mut [f32], hd: usize) {
            let mask = _mm_set1_epi8(0x0f);
            let eight = _mm_set1_epi8(8);
            for g in 0..hd / QK {
                let d = _mm256_set1_ps(super::scale(row, hd / 2, g));
                let b = _mm_loadu_si128(row.as_ptr().add(g * QK / 2) as *const __m128i);
                let lo = _mm_sub_epi8(_mm_and_si128(b, mask), eight); // values 0..16
                let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), mask), eight); // 16..32
                let out = buf.as_mut_ptr().add(g * QK);
                for (k, q) in [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)]
                    .into_iter()
                    .enumerate()
                {
                    let x = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
                    _mm256_storeu_ps(out.add(8 * k), _mm256_mul_ps(x, d));
                }
            }
        }
        // SAFETY: see the module's contract (avx2 checked; groups of 32 inside row and buf).
        unsafe { go(row, buf, hd) };
        &buf[..hd]
    }
}

/// The Hadamard rotation that quantized rows are stored in. Keys have a few outlier channels that
/// would set every group's scale; multiplying each row by an orthonormal Hadamard matrix `H` (block
/// size [`hadamard_block`]) spreads them over the row first. Attention needs no inverse for keys, as
/// `(Hq)·(Hk) = q·k`, and one for its output: `Σ p·(Hv) = H(Σ p·v)`, with `H·H = I`.
pub fn hadamard_block(hd: usize) -> usize {
    1 << hd.trailing_zeros()
}

/// Multiplies each block of `b` values of `x` by the orthonormal Hadamard matrix of size `b` (fast
/// Walsh–Hadamard transform, then the 1/√b normalization).
pub fn hadamard(x: &mut [f32], b: usize) {
    let norm = 1.0 / (b as f32).sqrt();
    for blk in x.chunks_exact_mut(b) {
        let mut h = 1;
        while h < b {
            for i in (0..b).step_by(2 * h) {
                for j in i..i + h {
                    let (a, c) = (blk[j], blk[j + h]);
                    blk[j] = a + c;
                    blk[j + h] = a - c;
                }
            }
            h *= 2;
        }
        for v in blk.iter_mut() {
            *v *= norm;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dot(a: &[f32], b: &[f32]) -> f32 {
        a.iter().zip(b).map(|(x, y)| x * y).sum()
    }

    /// Rows with outliers, zeros, negatives and tiny values.
    fn rows(hd: usize) -> Vec<Vec<f32>> {
        let mut s = 0x9e37_79b9u32;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s as f32 / u32::MAX as f32 * 2.0 - 1.0
        };
        let mut out: Vec<Vec<f32>> = (0..40)
            .map(|i| {
                (0..hd)
                    .map(|c| rnd() * if c % 17 == 3 { 30.0 } else { 1.0 } * 10f32.powi(i % 5 - 2))
                    .collect()
            })
            .collect();
        out.push(vec![0.0; hd]);
        out.push((0..hd).map(|c| -(c as f32)).collect());
        out
    }

    fn simd_equals_scalar<C: Codec>() {
        for hd in [32, 60, 64, 128, 256] {
            if C::row_len(hd) != hd && !hd.is_multiple_of(QK) {
                continue;
            }
            for x in rows(hd) {
                let mut row = vec![C::E::default(); C::row_len(hd)];
                C::encode(&x, &mut row);
                let (mut a, mut b) = (vec![0f32; hd], vec![0f32; hd]);
                let fast = C::decoder()(&row, &mut a).to_vec();
                let slow = C::decode_scalar(&row, &mut b).to_vec();
                assert_eq!(
                    fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    slow.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "hd {hd}"
                );
            }
        }
    }

    #[test]
    fn every_simd_decoder_gives_the_scalar_decoders_bits() {
        simd_equals_scalar::<F16>();
        simd_equals_scalar::<Bf16>();
        simd_equals_scalar::<Q8>();
        simd_equals_scalar::<Q4>();
    }

    /// Worst error of a row after encode and decode, relative to the row's largest magnitude.
    fn worst_error<C: Codec>(hd: usize) -> f32 {
        let mut worst = 0f32;
        for x in rows(hd) {
            let mut row = vec![C::E::default(); C::row_len(hd)];
            C::encode(&x, &mut row);
            let mut buf = vec![0f32; hd];
            let y = C::decode_scalar(&row, &mut buf);
            for (xg, yg) in x.chunks(QK).zip(y.chunks(QK)) {
                let amax = xg.iter().fold(0f32, |m, v| m.max(v.abs()));
                for (a, b) in xg.iter().zip(yg) {
                    if amax > 0.0 {
                        worst = worst.max((a - b).abs() / amax);
                    } else {
                        assert_eq!(*b, 0.0);
                    }
                }
            }
        }
        worst
    }

    #[test]
    fn quantized_rows_are_within_half_a_step_of_each_groups_scale() {
        // Half a step of 1/127 (Q8) of the group's largest magnitude, plus the f16 rounding of
        // the scale. Q4 has 16 levels, −8..7 steps of 1/8: half a step, except that a value near
        // the opposite extreme is clamped to 7 steps, a full step away.
        assert!(worst_error::<Q8>(64) <= 0.5 / 127.0 + 2e-3);
        assert!(worst_error::<Q4>(64) <= 1.0 / 8.0 + 2e-3);
        assert!(worst_error::<F16>(64) <= 1e-3);
    }

    #[test]
    fn row_sizes_are_8_5_and_4_5_bits_a_value() {
        assert_eq!(Q8::row_len(64), 68);
        assert_eq!(Q4::row_len(64), 36);
        assert_eq!(F16::row_len(64), 64);
    }

    #[test]
    fn hadamard_preserves_dot_products_and_is_its_own_inverse() {
        for hd in [64, 96, 128] {
            let b = hadamard_block(hd);
            let (x, y) = (&rows(hd)[7], &rows(hd)[11]);
            let (mut hx, mut hy) = (x.clone(), y.clone());
            hadamard(&mut hx, b);
            hadamard(&mut hy, b);
            let (d0, d1) = (dot(x, y), dot(&hx, &hy));
            assert!((d0 - d1).abs() <= 1e-4 * d0.abs().max(1.0), "{d0} vs {d1}");
            hadamard(&mut hx, b);
            for (a, c) in x.iter().zip(&hx) {
                assert!((a - c).abs() <= 1e-5 * a.abs().max(1.0));
            }
        }
        assert_eq!(hadamard_block(64), 64);
        assert_eq!(hadamard_block(96), 32);
    }
}
