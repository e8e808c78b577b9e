//! The i-quant grids' AVX2 dot products (`iqgrid.rs`'s formats, x86_64 only): each block's grid
//! points and signs expanded to bytes in registers and multiplied against Q8_K activations.

use super::super::avx2::{bit_bytes, load32};
use super::*;
use std::arch::x86_64::*;

/// `[e(0), …, e(7)]`, one per chunk, by a plain loop: a closure given to `array::from_fn`
/// is not inlined into a `#[target_feature]` caller (perf: a call per chunk).
macro_rules! per_chunk {
    (|$c:ident| $e:expr) => {{
        let mut a = [_mm256_setzero_si256(); 8];
        for ($c, v) in a.iter_mut().enumerate() {
            *v = $e;
        }
        a
    }};
}

/// A signed grid block in registers for AVX2: per 32 values the unsigned grid values, the
/// mask of those negated (0xFF bytes), and the scales as i16 (first 16 values low, next 16
/// high).
#[derive(Clone, Copy)]
pub struct SignedRegs {
    g: [__m256i; 8],
    m: [__m256i; 8],
    sc: [__m256i; 8],
}

/// The same for AVX-512: the sign bits stay bits, one mask register per 32 values.
#[derive(Clone, Copy)]
pub struct SignedRegs512 {
    g: [__m256i; 8],
    k: [__mmask32; 8],
    sc: [__m256i; 8],
}

#[inline(always)]
pub unsafe fn unpack_signed<G: SignedVec>(x: &G::Block) -> SignedRegs {
    let signs = G::sign_words(x);
    SignedRegs {
        g: per_chunk!(|c| G::grid(x, c)),
        m: per_chunk!(|c| bit_bytes(signs[c])),
        sc: scale_regs(G::scale_bytes(x)),
    }
}

#[inline(always)]
pub unsafe fn unpack_signed512<G: SignedVec>(x: &G::Block) -> SignedRegs512 {
    SignedRegs512 {
        g: per_chunk!(|c| G::grid_gather(x, c)),
        k: G::sign_words(x),
        sc: scale_regs(G::scale_bytes(x)),
    }
}

/// Each chunk's scales as i16 lanes (values 32c..32c + 16 low, the next 16 high) from the
/// block's 16 scale bytes (byte k: the scale of values 16k..16k + 16): one byte shuffle each.
#[inline(always)]
unsafe fn scale_regs(bytes: __m128i) -> [__m256i; 8] {
    let both = _mm256_broadcastsi128_si256(bytes);
    // i16 lane = byte k, then a zero byte (0x80 selects zero).
    let pick = |k: usize| _mm_set1_epi16((0x8000 | k) as i16);
    per_chunk!(|c| _mm256_shuffle_epi8(both, _mm256_set_m128i(pick(2 * c + 1), pick(2 * c))))
}

/// 16 scales (each < 128) as bytes in a vector.
#[inline(always)]
unsafe fn bytes_of(scales: [i16; 16]) -> __m128i {
    let s = scales.map(|s| s as u8);
    _mm_loadu_si128(s.as_ptr() as *const __m128i)
}

/// 2s + 1 of each byte s.
#[inline(always)]
unsafe fn odd(s: __m128i) -> __m128i {
    _mm_add_epi8(_mm_add_epi8(s, s), _mm_set1_epi8(1))
}

/// 16 nibbles from 8 bytes (low nibble first): 2s + 1 of each.
#[inline(always)]
unsafe fn nibble_scale_bytes(b: &[u8; 8]) -> __m128i {
    let v = _mm_loadl_epi64(b.as_ptr() as *const __m128i);
    let m4 = _mm_set1_epi8(15);
    let lo = _mm_and_si128(v, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
    odd(_mm_unpacklo_epi8(lo, hi))
}

/// The 16 scale bytes of a format with one scale per 32 values (both halves alike), from
/// the 8 scales s in the low byte of each u32 lane: 2s + 1 of each, twice.
#[inline(always)]
unsafe fn per32_scale_bytes(s: __m256i) -> __m128i {
    // Byte 0 of each u32 to the low 4 bytes of its 128-bit lane, then the two lanes' words
    // side by side.
    let pick = _mm256_set1_epi32(0x0C08_0400);
    let b = _mm256_shuffle_epi8(s, pick);
    let b = _mm256_permutevar8x32_epi32(b, _mm256_set_epi32(0, 0, 0, 0, 0, 0, 4, 0));
    let s8 = _mm256_castsi256_si128(b);
    odd(_mm_unpacklo_epi8(s8, s8))
}

/// Each byte f (< 128) completed by an eighth bit that makes its count of ones even
/// ([`KSIGNS`] in registers): the parity of the nibble (f ^ f >> 4) & 15 from a 16-entry
/// table.
#[inline(always)]
unsafe fn ksigns_bytes(f: __m256i) -> __m256i {
    let odd_parity = _mm256_set_epi64x(
        0x0080_8000_8000_0080,
        0x8000_0080_0080_8000_u64 as i64,
        0x0080_8000_8000_0080,
        0x8000_0080_0080_8000_u64 as i64,
    );
    let p = _mm256_and_si256(
        _mm256_xor_si256(f, _mm256_srli_epi16::<4>(f)),
        _mm256_set1_epi8(15),
    );
    _mm256_or_si256(f, _mm256_shuffle_epi8(odd_parity, p))
}

/// A vector's 8 u32 lanes.
#[inline(always)]
unsafe fn words(v: __m256i) -> [u32; 8] {
    std::mem::transmute(v)
}

/// The sign words of the 8 chunks whose 4 × 7 sign bits are the low 28 bits of lane c of
/// `aux` (IQ2_XXS, IQ3_XXS), each 7 completed by [`KSIGNS`]' eighth.
#[inline(always)]
unsafe fn ksigns_of_aux(aux: __m256i) -> [u32; 8] {
    let field = |v: __m256i, m: i32| _mm256_and_si256(v, _mm256_set1_epi32(m));
    let f = _mm256_or_si256(
        _mm256_or_si256(field(aux, 0x7F), field(_mm256_slli_epi32::<1>(aux), 0x7F00)),
        _mm256_or_si256(
            field(_mm256_slli_epi32::<2>(aux), 0x7F_0000),
            field(_mm256_slli_epi32::<3>(aux), 0x7F00_0000),
        ),
    );
    words(ksigns_bytes(f))
}

/// A signed grid's block in vectors: by default from the scalar [`SignedGrid`] methods;
/// each format computes what it can in registers instead. All give the scalar methods' bits
/// (tested through the dot products at every level).
pub trait SignedVec: SignedGrid {
    /// Whether [`SignedVec::grid_gather`] gathers (else it is [`SignedVec::grid`]).
    const GATHERS: bool = false;
    /// Chunk c (values 32c..32c + 32) as one vector of its 32 unsigned grid values.
    ///
    /// # Safety
    /// AVX2 runs (the contract of [`Avx2`]).
    #[inline(always)]
    unsafe fn grid(x: &Self::Block, c: usize) -> __m256i {
        let (w, _) = Self::chunk(x, c);
        _mm256_set_epi64x(w[3] as i64, w[2] as i64, w[1] as i64, w[0] as i64)
    }
    /// [`SignedVec::grid`] where gathers pay: decode at the AVX-512 level, and staging
    /// (many blocks, each once) at every level.
    ///
    /// # Safety
    /// AVX2 runs.
    #[inline(always)]
    unsafe fn grid_gather(x: &Self::Block, c: usize) -> __m256i {
        Self::grid(x, c)
    }
    /// The 8 chunks' sign words (bit i of word c: value 32c + i negated).
    ///
    /// # Safety
    /// AVX2 runs.
    #[inline(always)]
    unsafe fn sign_words(x: &Self::Block) -> [u32; 8] {
        let mut w = [0u32; 8];
        for (c, w) in w.iter_mut().enumerate() {
            *w = Self::chunk(x, c).1;
        }
        w
    }
    /// The 16 integer scales (each ≤ 31) as bytes.
    ///
    /// # Safety
    /// AVX2 runs.
    #[inline(always)]
    unsafe fn scale_bytes(x: &Self::Block) -> __m128i {
        bytes_of(Self::scales(x))
    }
}

/// 8 bytes zero-extended to 8 i32 lanes.
#[inline(always)]
unsafe fn bytes8(b: &[u8]) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(b[..8].as_ptr() as *const __m128i))
}

impl IQ2XXS {
    /// The 8 chunks' sign-and-scale words (the u32 after each chunk's 4 index bytes).
    #[inline(always)]
    unsafe fn aux(x: &BlockIQ2XXS) -> __m256i {
        let a = _mm256_castsi256_ps(load32(&x.qs[..32]));
        let b = _mm256_castsi256_ps(load32(&x.qs[32..]));
        // Odd words of each lane: [a0 a1 b4 b5 | a2 a3 b6 b7], then in chunk order.
        let odd = _mm256_castps_si256(_mm256_shuffle_ps::<0b11_01_11_01>(a, b));
        _mm256_permute4x64_epi64::<0b11_01_10_00>(odd)
    }
}

impl SignedVec for IQ2XXS {
    #[inline(always)]
    unsafe fn sign_words(x: &BlockIQ2XXS) -> [u32; 8] {
        ksigns_of_aux(Self::aux(x))
    }
    #[inline(always)]
    unsafe fn scale_bytes(x: &BlockIQ2XXS) -> __m128i {
        per32_scale_bytes(_mm256_srli_epi32::<28>(Self::aux(x)))
    }
}

impl SignedVec for IQ2XS {
    /// Each u16's top 7 bits, completed.
    #[inline(always)]
    unsafe fn sign_words(x: &BlockIQ2XS) -> [u32; 8] {
        let a = _mm256_srli_epi16::<9>(load32(&x.qs[..32]));
        let b = _mm256_srli_epi16::<9>(load32(&x.qs[32..]));
        // [a0..7 b0..7 | a8..15 b8..15] as bytes, then in order.
        let f = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_packus_epi16(a, b));
        words(ksigns_bytes(f))
    }
    #[inline(always)]
    unsafe fn scale_bytes(x: &BlockIQ2XS) -> __m128i {
        nibble_scale_bytes(&x.scales)
    }
}

impl SignedVec for IQ2S {
    #[inline(always)]
    unsafe fn sign_words(x: &BlockIQ2S) -> [u32; 8] {
        words(load32(&x.qs[32..]))
    }
    #[inline(always)]
    unsafe fn scale_bytes(x: &BlockIQ2S) -> __m128i {
        nibble_scale_bytes(&x.scales)
    }
}

/// Eight 4-value entries of an IQ3 grid by scalar loads: entry j's index is byte j of `q`
/// with bit j of `hi` as its ninth bit.
#[inline(always)]
unsafe fn entries8<const N: usize>(table: &[u32; N], q: &[u8], hi: usize) -> __m256i {
    let q: &[u8; 8] = q[..8].try_into().expect("8 index bytes");
    macro_rules! e {
        ($j:literal) => {
            table[q[$j] as usize | (hi >> $j & 1) << 8] as i32
        };
    }
    _mm256_set_epi32(e!(7), e!(6), e!(5), e!(4), e!(3), e!(2), e!(1), e!(0))
}

/// The IQ3 types look their 4-value entries up by scalar loads in decode at the AVX2 level,
/// and gather them with one `vpgatherdd` per 32 values elsewhere (indices computed in
/// registers: 8 bits for IQ3_XXS's 256 entries, 9 for IQ3_S's 512, so every gathered load
/// is inside its table). Gathers are slow on the CPUs that stop at AVX2 (Zen 2: IQ3_XXS
/// decode 0.73× llama.cpp's with them), and on Intel's since the Gather Data Sampling fix;
/// on AMD's AVX-512 cores decode takes the AVX2 path (`level::gathers_fast`).
impl SignedVec for IQ3XXS {
    const GATHERS: bool = true;
    #[inline(always)]
    unsafe fn grid(x: &BlockIQ3XXS, c: usize) -> __m256i {
        entries8(&IQ3XXS_GRID, &x.qs[8 * c..], 0)
    }
    #[inline(always)]
    unsafe fn grid_gather(x: &BlockIQ3XXS, c: usize) -> __m256i {
        let idx = bytes8(&x.qs[8 * c..]);
        _mm256_i32gather_epi32::<4>(IQ3XXS_GRID.as_ptr() as *const i32, idx)
    }
    #[inline(always)]
    unsafe fn sign_words(x: &BlockIQ3XXS) -> [u32; 8] {
        ksigns_of_aux(load32(&x.qs[64..]))
    }
    #[inline(always)]
    unsafe fn scale_bytes(x: &BlockIQ3XXS) -> __m128i {
        per32_scale_bytes(_mm256_srli_epi32::<28>(load32(&x.qs[64..])))
    }
}

impl SignedVec for IQ3S {
    const GATHERS: bool = true;
    /// Entry j's ninth index bit is bit j of `qh[c]`.
    #[inline(always)]
    unsafe fn grid(x: &BlockIQ3S, c: usize) -> __m256i {
        entries8(&IQ3S_GRID, &x.qs[8 * c..], x.qh[c] as usize)
    }
    #[inline(always)]
    unsafe fn grid_gather(x: &BlockIQ3S, c: usize) -> __m256i {
        let hi = _mm256_srlv_epi32(
            _mm256_set1_epi32(x.qh[c] as i32),
            _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
        );
        let hi = _mm256_slli_epi32::<8>(_mm256_and_si256(hi, _mm256_set1_epi32(1)));
        let idx = _mm256_or_si256(bytes8(&x.qs[8 * c..]), hi);
        _mm256_i32gather_epi32::<4>(IQ3S_GRID.as_ptr() as *const i32, idx)
    }
    #[inline(always)]
    unsafe fn sign_words(x: &BlockIQ3S) -> [u32; 8] {
        words(load32(&x.signs))
    }
    /// One nibble per 32 values (low nibble first), each for both halves.
    #[inline(always)]
    unsafe fn scale_bytes(x: &BlockIQ3S) -> __m128i {
        let v = _mm_cvtsi32_si128(u32::from_le_bytes(x.scales) as i32);
        let m4 = _mm_set1_epi8(15);
        let s = _mm_unpacklo_epi8(
            _mm_and_si128(v, m4),
            _mm_and_si128(_mm_srli_epi16::<4>(v), m4),
        );
        odd(_mm_unpacklo_epi8(s, s))
    }
}

/// [`Stage::stage`] for a signed grid: each chunk's values with their signs applied in
/// registers ((g ^ m) − m), scattered to the tile 4 bytes at a time; the bias term from
/// maddubs/madd sums.
#[inline(always)]
pub unsafe fn stage_signed<G: SignedVec>(x: &G::Block, r: usize, t: &mut TileGrid) {
    let signs = G::sign_words(x);
    let sb = G::scale_bytes(x);
    let sc = scale_regs(sb);
    let mut bias = _mm256_setzero_si256();
    for (c, s) in signs.into_iter().enumerate() {
        let m = bit_bytes(s);
        let v = _mm256_sub_epi8(_mm256_xor_si256(G::grid_gather(x, c), m), m);
        let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), v);
        bias = _mm256_add_epi32(bias, _mm256_madd_epi16(pairs, sc[c]));
        let w = words(v);
        for (i, w) in w.into_iter().enumerate() {
            t.q[8 * c + i][4 * r..4 * r + 4].copy_from_slice(&w.to_le_bytes());
        }
    }
    let b = words(bias);
    t.bias[r] = 128 * b.iter().map(|&v| v as i32).sum::<i32>();
    let s: [u8; 16] = std::mem::transmute(sb);
    for (row, s) in t.sc.iter_mut().zip(s) {
        row[r] = s as i16;
    }
    t.d[r] = G::d(x);
}

/// Σ_c madd(scales_c, maddubs(g_c, ±y_c)): the signs applied to the activations ((y ^ m) −
/// m negates y where m is −1; |y| ≤ 127), the grid values (≤ 62) as maddubs's unsigned
/// operand: a pair ≤ 2·62·127 = 15 748.
#[inline(always)]
pub unsafe fn ilanes_signed(u: &SignedRegs, y: &BlockQ8K) -> __m256i {
    let mut sum = _mm256_setzero_si256();
    for c in 0..8 {
        let yc = load32(&y.qs[32 * c..32 * c + 32]);
        let sy = _mm256_sub_epi8(_mm256_xor_si256(yc, u.m[c]), u.m[c]);
        let p = _mm256_maddubs_epi16(u.g[c], sy);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(u.sc[c], p));
    }
    sum
}

/// [`ilanes_signed`] with the signs as mask registers: y negated where its bit is set (0 − y
/// under the mask), the same lanes.
#[inline(always)]
pub unsafe fn ilanes_signed512(u: &SignedRegs512, y: &BlockQ8K) -> __m256i {
    let zero = _mm256_setzero_si256();
    let mut sum = _mm256_setzero_si256();
    for c in 0..8 {
        let yc = load32(&y.qs[32 * c..32 * c + 32]);
        let sy = _mm256_mask_sub_epi8(yc, u.k[c], zero, yc);
        let p = _mm256_maddubs_epi16(u.g[c], sy);
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(u.sc[c], p));
    }
    sum
}

/// An IQ1 block in registers: per 32 values the grid values + 1 (0, 1, 2), and two scale
/// vectors in the i16 lanes of the value pairs: 8·scale, and (δ − 8)·scale (δ the shift of
/// the pair's 8 values; scales first 16 values low); where a shift covers 16 values or more
/// (IQ1_S), also (δ − 8)·scale once per 16 values, for the activations' sums of 16 (`bsums`).
#[derive(Clone, Copy)]
pub struct ShiftedRegs {
    g1: [__m256i; 8],
    sc8: [__m256i; 8],
    scd: [__m256i; 8],
    d16: Option<__m256i>,
}

/// An IQ1 block in vectors: its grid words by default from [`ShiftedGrid::chunk`]; each
/// format computes its shifts and scales in registers (tested through the dot products).
pub trait ShiftedVec: ShiftedGrid {
    /// Chunk c's 32 grid values (−1, 0, 1).
    ///
    /// # Safety
    /// AVX2 runs (the contract of [`Avx2`]).
    #[inline(always)]
    unsafe fn grid(x: &Self::Block, c: usize) -> __m256i {
        let (w, _) = Self::chunk(x, c);
        _mm256_set_epi64x(w[3] as i64, w[2] as i64, w[1] as i64, w[0] as i64)
    }
    /// Each chunk's δ − 8 (−7 or −9) in the i16 lanes of its value pairs.
    ///
    /// # Safety
    /// AVX2 runs.
    unsafe fn dm8(x: &Self::Block) -> [__m256i; 8];
    /// (δ − 8)·scale for each 16 values in i16 lanes, where one shift covers them, given
    /// the scale bytes ([`ShiftedVec::scale_bytes`]).
    ///
    /// # Safety
    /// AVX2 runs.
    #[inline(always)]
    unsafe fn d16(_x: &Self::Block, _scale_bytes: __m128i) -> Option<__m256i> {
        None
    }
    /// The 16 integer scales (each ≤ 15) as bytes.
    ///
    /// # Safety
    /// AVX2 runs.
    #[inline(always)]
    unsafe fn scale_bytes(x: &Self::Block) -> __m128i {
        bytes_of(Self::scales(x))
    }
}

/// −7 where a mask byte is 0, −9 where it is −1: δ − 8 for δ = +1 and −1.
#[inline(always)]
unsafe fn minus_7_or_9(neg: __m128i) -> __m128i {
    _mm_add_epi8(_mm_set1_epi8(-7), _mm_add_epi8(neg, neg))
}

/// IQ1_S's δ − 8 (−7 or −9) of chunk c in i16 lane c: bit 15 of its `qh` word.
#[inline(always)]
unsafe fn iq1s_dm(x: &BlockIQ1S) -> __m128i {
    let neg = _mm_srai_epi16::<15>(_mm_loadu_si128(x.qh.as_ptr() as *const __m128i));
    _mm_add_epi16(_mm_set1_epi16(-7), _mm_add_epi16(neg, neg))
}

impl ShiftedVec for IQ1S {
    /// One shift per 32 values: bit 15 of the chunk's `qh` word.
    #[inline(always)]
    unsafe fn dm8(x: &BlockIQ1S) -> [__m256i; 8] {
        let both = _mm256_broadcastsi128_si256(iq1s_dm(x));
        per_chunk!(|c| {
            let pick = _mm256_set1_epi16((((2 * c + 1) << 8) | (2 * c)) as i16);
            _mm256_shuffle_epi8(both, pick)
        })
    }
    #[inline(always)]
    unsafe fn d16(x: &BlockIQ1S, sb: __m128i) -> Option<__m256i> {
        // Chunk c's δ − 8 in i16 lanes 2c and 2c + 1.
        let dm = iq1s_dm(x);
        let dm = _mm256_set_m128i(_mm_unpackhi_epi16(dm, dm), _mm_unpacklo_epi16(dm, dm));
        Some(_mm256_mullo_epi16(dm, _mm256_cvtepu8_epi16(sb)))
    }
    /// Bits 12..=14 of each chunk's `qh` word, for both halves.
    #[inline(always)]
    unsafe fn scale_bytes(x: &BlockIQ1S) -> __m128i {
        let qh = _mm_loadu_si128(x.qh.as_ptr() as *const __m128i);
        let s = _mm_and_si128(_mm_srli_epi16::<12>(qh), _mm_set1_epi16(7));
        let s = _mm_packus_epi16(s, s);
        odd(_mm_unpacklo_epi8(s, s))
    }
}

impl ShiftedVec for IQ1M {
    /// Scale k is bits 3(k % 4).. of scale word k / 4: each word in four u16 lanes, shifted
    /// left by 9 − 3(k % 4) (a multiply), then right by 9.
    #[inline(always)]
    unsafe fn scale_bytes(x: &BlockIQ1M) -> __m128i {
        let w = _mm_loadl_epi64(x.scales.as_ptr() as *const __m128i);
        let lo = _mm_shuffle_epi8(
            w,
            _mm_set_epi8(3, 2, 3, 2, 3, 2, 3, 2, 1, 0, 1, 0, 1, 0, 1, 0),
        );
        let hi = _mm_shuffle_epi8(
            w,
            _mm_set_epi8(7, 6, 7, 6, 7, 6, 7, 6, 5, 4, 5, 4, 5, 4, 5, 4),
        );
        let mult = _mm_set_epi16(1, 8, 64, 512, 1, 8, 64, 512);
        let take = |v: __m128i| {
            let v = _mm_srli_epi16::<9>(_mm_mullo_epi16(v, mult));
            _mm_and_si128(v, _mm_set1_epi16(7))
        };
        odd(_mm_packus_epi16(take(lo), take(hi)))
    }
    /// One shift per 8 values: bits 3 and 7 of each `qh` byte (runs 2i and 2i + 1).
    #[inline(always)]
    unsafe fn dm8(x: &BlockIQ1M) -> [__m256i; 8] {
        let qh = _mm_loadu_si128(x.qh.as_ptr() as *const __m128i);
        let bit = |b: i8| {
            let m = _mm_set1_epi8(b);
            _mm_cmpeq_epi8(_mm_and_si128(qh, m), m)
        };
        let (lo, hi) = (bit(0x08), bit(0x80u8 as i8));
        // Runs 0..16 and 16..32 in order, as −7 / −9 bytes.
        let runs = [
            minus_7_or_9(_mm_unpacklo_epi8(lo, hi)),
            minus_7_or_9(_mm_unpackhi_epi8(lo, hi)),
        ];
        per_chunk!(|c| {
            // Byte 4c + n (n = 0..4) of the runs, each in 4 i16 lanes.
            let k = (4 * (c % 4)) as i8;
            let pick = _mm_set_epi8(
                k + 3,
                k + 3,
                k + 3,
                k + 3,
                k + 2,
                k + 2,
                k + 2,
                k + 2,
                k + 1,
                k + 1,
                k + 1,
                k + 1,
                k,
                k,
                k,
                k,
            );
            _mm256_cvtepi8_epi16(_mm_shuffle_epi8(runs[c / 4], pick))
        })
    }
}

#[inline(always)]
pub unsafe fn unpack_shifted<G: ShiftedVec>(x: &G::Block) -> ShiftedRegs {
    let one = _mm256_set1_epi8(1);
    let sb = G::scale_bytes(x);
    // 8·scale ≤ 120: the bytes shifted within their i16 lanes carry nothing across.
    let sc8 = scale_regs(_mm_slli_epi16::<3>(sb));
    let sc = scale_regs(sb);
    let dm8 = G::dm8(x);
    ShiftedRegs {
        g1: per_chunk!(|c| _mm256_add_epi8(G::grid(x, c), one)),
        sc8,
        scd: per_chunk!(|c| _mm256_mullo_epi16(sc[c], dm8[c])),
        d16: G::d16(x, sb),
    }
}

/// Lanes whose total is [`ilanes_shifted`]'s, for the tiles' order (which adds a block's
/// lanes first): where one shift covers 16 values, the shifts' Σ (δ − 8)·scale·y is one
/// madd with the activations' sums of 16 per block (bsums ≤ 16·127), not a maddubs and a
/// madd per 32 values.
#[inline(always)]
pub unsafe fn itotal_shifted(u: &ShiftedRegs, y: &BlockQ8K) -> __m256i {
    let Some(d16) = u.d16 else {
        return ilanes_shifted(u, y);
    };
    let mut sum = _mm256_madd_epi16(d16, load32(&y.bsums));
    for c in 0..8 {
        let yc = load32(&y.qs[32 * c..32 * c + 32]);
        sum = _mm256_add_epi32(sum, grid_part(u, c, yc));
    }
    sum
}

/// Chunk `c`'s madd(8·scales_c, maddubs(g + 1, y)): the grid values' share of its pair sums.
#[inline(always)]
unsafe fn grid_part(u: &ShiftedRegs, c: usize, yc: __m256i) -> __m256i {
    _mm256_madd_epi16(u.sc8[c], _mm256_maddubs_epi16(u.g1[c], yc))
}

/// Σ_c madd(8·scales_c, maddubs(g + 1, y)) + madd((δ − 8)·scales_c, maddubs(1, y)): the
/// exact Σ scale·(8g + δ)·y of each pair (pair sums ≤ 2·2·127, times ≤ 9·15).
#[inline(always)]
pub unsafe fn ilanes_shifted(u: &ShiftedRegs, y: &BlockQ8K) -> __m256i {
    let one = _mm256_set1_epi8(1);
    let mut sum = _mm256_setzero_si256();
    for c in 0..8 {
        let yc = load32(&y.qs[32 * c..32 * c + 32]);
        let p = grid_part(u, c, yc);
        let s = _mm256_madd_epi16(u.scd[c], _mm256_maddubs_epi16(one, yc));
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(p, s));
    }
    sum
}
