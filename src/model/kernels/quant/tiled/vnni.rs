//! The AVX-512 VNNI tile kernels: per tile, the 16 rows' exact integer block sums with T
//! activation blocks, one `dpbusd` per 4 values of 16 rows.

use super::super::avx2::{load16, load64};
use super::*;
use std::arch::x86_64::*;

/// Four activation values (i8) broadcast to every i32 lane.
#[inline(always)]
unsafe fn bcast4(q: &[i8]) -> __m512i {
    _mm512_set1_epi32(four(q))
}

/// A format's tile kernel (see the module's SAFETY contract in `quant`: VNNI present).
pub trait TileKernel: Tiled {
    /// The 16 rows' integer sums of block `t` with `ys` (and `ysum` of each where `YSUM`).
    unsafe fn isum<const T: usize>(
        t: &Self::Tile,
        ys: [&Self::Act; T],
        ysums: [i32; T],
    ) -> [__m512i; T];
    /// The 16 rows' float scales with `y` (the same operations as `Format::scale`).
    unsafe fn scale(t: &Self::Tile, y: &Self::Act) -> __m512;
    /// The 16 rows' min terms (the same operations as `Format::min_term`).
    unsafe fn min(_t: &Self::Tile, _y: &Self::Act) -> __m512 {
        _mm512_setzero_ps()
    }
}

#[inline(always)]
unsafe fn halves(d: &[f16; TR]) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(d.as_ptr() as *const __m256i))
}

/// The 16 rows' Σ q·y over a 32-value block of nibbles (plus fifth bits from `qh`).
#[inline(always)]
unsafe fn isum_nibbles<const T: usize>(
    qs: &[[u8; 4 * TR]; 4],
    qh: Option<&[u8; 4 * TR]>,
    ys: [&[i8; 32]; T],
) -> [__m512i; T] {
    let m4 = _mm512_set1_epi8(0x0F);
    let one = _mm512_set1_epi8(1);
    let h = qh.map(|h| load64(h));
    let mut acc = [_mm512_setzero_si512(); T];
    for g in 0..4 {
        let w = load64(&qs[g]);
        let mut lo = _mm512_and_si512(w, m4);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), m4);
        if let Some(h) = h {
            // Bits 2g and 2g+1 of each byte, moved to bit 4.
            let (b0, b1) = match g {
                0 => (h, _mm512_srli_epi16::<1>(h)),
                1 => (_mm512_srli_epi16::<2>(h), _mm512_srli_epi16::<3>(h)),
                2 => (_mm512_srli_epi16::<4>(h), _mm512_srli_epi16::<5>(h)),
                _ => (_mm512_srli_epi16::<6>(h), _mm512_srli_epi16::<7>(h)),
            };
            lo = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(_mm512_and_si512(b0, one)));
            hi = _mm512_or_si512(hi, _mm512_slli_epi16::<4>(_mm512_and_si512(b1, one)));
        }
        for i in 0..T {
            let y = &ys[i][8 * g..];
            acc[i] = _mm512_dpbusd_epi32(acc[i], lo, bcast4(y));
            acc[i] = _mm512_dpbusd_epi32(acc[i], hi, bcast4(&y[4..]));
        }
    }
    acc
}

impl TileKernel for Q4_0 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ4_0,
        ys: [&BlockQ8_0; T],
        ysums: [i32; T],
    ) -> [__m512i; T] {
        let acc = isum_nibbles(&t.qs, None, ys.map(|y| &y.qs));
        std::array::from_fn(|i| _mm512_sub_epi32(acc[i], _mm512_set1_epi32(ysums[i])))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4_0, y: &BlockQ8_0) -> __m512 {
        _mm512_mul_ps(halves(&t.d), _mm512_set1_ps(y.d))
    }
}

impl TileKernel for Q4_1 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(t: &TileQ4_1, ys: [&BlockQ8_1; T], _: [i32; T]) -> [__m512i; T] {
        isum_nibbles(&t.qs, None, ys.map(|y| &y.qs))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4_1, y: &BlockQ8_1) -> __m512 {
        _mm512_mul_ps(halves(&t.d), _mm512_set1_ps(y.d))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ4_1, y: &BlockQ8_1) -> __m512 {
        _mm512_mul_ps(halves(&t.m), _mm512_set1_ps(y.s))
    }
}

impl TileKernel for Q5_0 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ5_0,
        ys: [&BlockQ8_0; T],
        ysums: [i32; T],
    ) -> [__m512i; T] {
        let acc = isum_nibbles(&t.qs, Some(&t.qh), ys.map(|y| &y.qs));
        std::array::from_fn(|i| _mm512_sub_epi32(acc[i], _mm512_set1_epi32(ysums[i])))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5_0, y: &BlockQ8_0) -> __m512 {
        _mm512_mul_ps(halves(&t.d), _mm512_set1_ps(y.d))
    }
}

impl TileKernel for Q5_1 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(t: &TileQ5_1, ys: [&BlockQ8_1; T], _: [i32; T]) -> [__m512i; T] {
        isum_nibbles(&t.qs, Some(&t.qh), ys.map(|y| &y.qs))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5_1, y: &BlockQ8_1) -> __m512 {
        _mm512_mul_ps(halves(&t.d), _mm512_set1_ps(y.d))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ5_1, y: &BlockQ8_1) -> __m512 {
        _mm512_mul_ps(halves(&t.m), _mm512_set1_ps(y.s))
    }
}

impl TileKernel for Q8_0 {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileQ8_0,
        ys: [&BlockQ8_0; T],
        ysums: [i32; T],
    ) -> [__m512i; T] {
        let mut acc = [_mm512_setzero_si512(); T];
        for g in 0..8 {
            let w = load64(&t.qs[g]);
            for i in 0..T {
                acc[i] = _mm512_dpbusd_epi32(acc[i], w, bcast4(&ys[i].qs[4 * g..]));
            }
        }
        std::array::from_fn(|i| _mm512_sub_epi32(acc[i], _mm512_set1_epi32(ysums[i])))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ8_0, y: &BlockQ8_0) -> __m512 {
        _mm512_mul_ps(halves(&t.d), _mm512_set1_ps(y.d))
    }
}

/// The 16 rows' Σ_j sc_j · Σ q·y over a Q4_K/Q5_K super-block: per sub-block j, its 4 nibble
/// groups `q[j][..4]` and, where N is 5 (Q5_K), its fifth bits `q[j][4]`.
#[inline(always)]
unsafe fn isum_k<const N: usize, const T: usize>(
    q: &[[[u8; 4 * TR]; N]; 8],
    scales: &[[u8; TR]; 8],
    ys: [&BlockQ8K; T],
) -> [__m512i; T] {
    let m4 = _mm512_set1_epi8(0x0F);
    let one = _mm512_set1_epi8(1);
    let mut total = [_mm512_setzero_si512(); T];
    for j in 0..8 {
        let h = (N == 5).then(|| load64(&q[j][4]));
        let mut part = [_mm512_setzero_si512(); T];
        for (gl, group) in q[j].iter().take(4).enumerate() {
            let g = 4 * j + gl;
            let w = load64(group);
            let mut lo = _mm512_and_si512(w, m4);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16::<4>(w), m4);
            if let Some(h) = h {
                let (b0, b1) = match gl {
                    0 => (h, _mm512_srli_epi16::<1>(h)),
                    1 => (_mm512_srli_epi16::<2>(h), _mm512_srli_epi16::<3>(h)),
                    2 => (_mm512_srli_epi16::<4>(h), _mm512_srli_epi16::<5>(h)),
                    _ => (_mm512_srli_epi16::<6>(h), _mm512_srli_epi16::<7>(h)),
                };
                lo = _mm512_or_si512(lo, _mm512_slli_epi16::<4>(_mm512_and_si512(b0, one)));
                hi = _mm512_or_si512(hi, _mm512_slli_epi16::<4>(_mm512_and_si512(b1, one)));
            }
            for i in 0..T {
                let y = &ys[i].qs[8 * g..];
                part[i] = _mm512_dpbusd_epi32(part[i], lo, bcast4(y));
                part[i] = _mm512_dpbusd_epi32(part[i], hi, bcast4(&y[4..]));
            }
        }
        let sc = _mm512_cvtepu8_epi32(load16(&scales[j]));
        for i in 0..T {
            total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(part[i], sc));
        }
    }
    total
}

/// −(d_y · dmin) · Σ_j m_j · (Σ of y over sub-block j), per row (Q4_K/Q5_K).
#[inline(always)]
unsafe fn min_k(mins: &[[u8; TR]; 8], dmin: &[f16; TR], y: &BlockQ8K) -> __m512 {
    let mut msum = _mm512_setzero_si512();
    for (j, mins) in mins.iter().enumerate() {
        let s = y.bsums[2 * j] as i32 + y.bsums[2 * j + 1] as i32;
        let m = _mm512_cvtepu8_epi32(load16(mins));
        msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(m, _mm512_set1_epi32(s)));
    }
    let dd = _mm512_mul_ps(_mm512_set1_ps(y.d), halves(dmin));
    // Negation as a sign flip (exact, −0 included), as the scalar `-(..)`.
    let sign = _mm512_set1_epi32(i32::MIN);
    let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dd), sign));
    _mm512_mul_ps(neg, _mm512_cvtepi32_ps(msum))
}

impl TileKernel for Q4K {
    #[inline(always)]
    unsafe fn isum<const T: usize>(t: &TileQ4K, ys: [&BlockQ8K; T], _: [i32; T]) -> [__m512i; T] {
        isum_k::<4, T>(bytemuck::cast_ref(&t.qs), &t.sc, ys)
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ4K, y: &BlockQ8K) -> __m512 {
        _mm512_mul_ps(_mm512_set1_ps(y.d), halves(&t.d))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ4K, y: &BlockQ8K) -> __m512 {
        min_k(&t.m, &t.dmin, y)
    }
}

impl TileKernel for Q5K {
    #[inline(always)]
    unsafe fn isum<const T: usize>(t: &TileQ5K, ys: [&BlockQ8K; T], _: [i32; T]) -> [__m512i; T] {
        isum_k::<5, T>(&t.q, &t.sc, ys)
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ5K, y: &BlockQ8K) -> __m512 {
        _mm512_mul_ps(_mm512_set1_ps(y.d), halves(&t.d))
    }
    #[inline(always)]
    unsafe fn min(t: &TileQ5K, y: &BlockQ8K) -> __m512 {
        min_k(&t.m, &t.dmin, y)
    }
}

impl TileKernel for Q6K {
    #[inline(always)]
    unsafe fn isum<const T: usize>(t: &TileQ6K, ys: [&BlockQ8K; T], _: [i32; T]) -> [__m512i; T] {
        let m4 = _mm512_set1_epi8(0x0F);
        let m2 = _mm512_set1_epi8(3);
        let mut total = [_mm512_setzero_si512(); T];
        for j in 0..16 {
            let (l0, l1, h) = (load64(&t.q[j][0]), load64(&t.q[j][1]), load64(&t.q[j][2]));
            let hi = |v: __m512i| _mm512_slli_epi16::<4>(_mm512_and_si512(v, m2));
            let v = [
                _mm512_or_si512(_mm512_and_si512(l0, m4), hi(h)),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(l0), m4),
                    hi(_mm512_srli_epi16::<2>(h)),
                ),
                _mm512_or_si512(_mm512_and_si512(l1, m4), hi(_mm512_srli_epi16::<4>(h))),
                _mm512_or_si512(
                    _mm512_and_si512(_mm512_srli_epi16::<4>(l1), m4),
                    hi(_mm512_srli_epi16::<6>(h)),
                ),
            ];
            let sc = _mm512_cvtepi8_epi32(load16(&t.sc[j]));
            for i in 0..T {
                let y = &ys[i].qs[16 * j..];
                let mut p = _mm512_setzero_si512();
                for (k, v) in v.iter().enumerate() {
                    p = _mm512_dpbusd_epi32(p, *v, bcast4(&y[4 * k..]));
                }
                // Σ (q − 32)·y = Σ q·y − 32 · (Σ of y over the 16 values).
                let p = _mm512_sub_epi32(p, _mm512_set1_epi32(32 * ys[i].bsums[j] as i32));
                total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(p, sc));
            }
        }
        total
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ6K, y: &BlockQ8K) -> __m512 {
        _mm512_mul_ps(_mm512_set1_ps(y.d), halves(&t.d))
    }
}

/// The 16 rows' Σ q·y over the 16 values of group `g` of a Q2_K/Q3_K tile (2-bit quants in
/// `qs`, and where given the third bits in `hb`), with T activation blocks.
#[inline(always)]
unsafe fn isum_crumbs<const T: usize>(
    qs: &[u8; 4 * TR],
    hb: Option<&[u8; 4 * TR]>,
    g: usize,
    ys: [&BlockQ8K; T],
) -> [__m512i; T] {
    let m3 = _mm512_set1_epi8(3);
    let one = _mm512_set1_epi8(1);
    let w = load64(qs);
    let h = hb.map(|h| load64(h));
    let mut part = [_mm512_setzero_si512(); T];
    for k in 0..4 {
        let mut v = _mm512_and_si512(shift_right(w, 2 * k), m3);
        if let Some(h) = h {
            let bit = _mm512_and_si512(shift_right(h, 4 * (g % 2) + k), one);
            v = _mm512_or_si512(v, _mm512_slli_epi16::<2>(bit));
        }
        for i in 0..T {
            part[i] = _mm512_dpbusd_epi32(part[i], v, bcast4(&ys[i].qs[16 * g + 4 * k..]));
        }
    }
    part
}

/// Each 16-bit lane of `v` shifted right by `n` (0..8; what crosses into a byte is masked off by
/// the caller).
#[inline(always)]
unsafe fn shift_right(v: __m512i, n: usize) -> __m512i {
    _mm512_srl_epi16(v, _mm_cvtsi32_si128(n as i32))
}

impl TileKernel for Q2K {
    #[inline(always)]
    unsafe fn isum<const T: usize>(t: &TileQ2K, ys: [&BlockQ8K; T], _: [i32; T]) -> [__m512i; T] {
        let m4 = _mm512_set1_epi32(0x0F);
        let mut total = [_mm512_setzero_si512(); T];
        for g in 0..16 {
            let part = isum_crumbs(&t.qs[g], None, g, ys);
            let sc = _mm512_and_si512(_mm512_cvtepu8_epi32(load16(&t.scm[g])), m4);
            for i in 0..T {
                total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(part[i], sc));
            }
        }
        total
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ2K, y: &BlockQ8K) -> __m512 {
        _mm512_mul_ps(_mm512_set1_ps(y.d), halves(&t.d))
    }
    /// −(d_y · dmin) · Σ_j m_j · bsum_j, per row.
    #[inline(always)]
    unsafe fn min(t: &TileQ2K, y: &BlockQ8K) -> __m512 {
        let mut msum = _mm512_setzero_si512();
        for j in 0..16 {
            let m = _mm512_srli_epi32::<4>(_mm512_cvtepu8_epi32(load16(&t.scm[j])));
            let s = _mm512_set1_epi32(y.bsums[j] as i32);
            msum = _mm512_add_epi32(msum, _mm512_mullo_epi32(m, s));
        }
        let dd = _mm512_mul_ps(_mm512_set1_ps(y.d), halves(&t.dmin));
        let sign = _mm512_set1_epi32(i32::MIN);
        let neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(dd), sign));
        _mm512_mul_ps(neg, _mm512_cvtepi32_ps(msum))
    }
}

impl TileKernel for Q3K {
    /// Per group g (a sub-block of 16): Σ q·y less 4 · bsum_g (q − 4 is the signed value), times
    /// the row's scale.
    #[inline(always)]
    unsafe fn isum<const T: usize>(t: &TileQ3K, ys: [&BlockQ8K; T], _: [i32; T]) -> [__m512i; T] {
        let mut total = [_mm512_setzero_si512(); T];
        for g in 0..16 {
            let part = isum_crumbs(t.qs(g), Some(t.hb(g)), g, ys);
            let sc = _mm512_cvtepi8_epi32(load16(&t.sc[g]));
            for i in 0..T {
                let p = _mm512_sub_epi32(part[i], _mm512_set1_epi32(4 * ys[i].bsums[g] as i32));
                total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(p, sc));
            }
        }
        total
    }
    #[inline(always)]
    unsafe fn scale(t: &TileQ3K, y: &BlockQ8K) -> __m512 {
        _mm512_mul_ps(_mm512_set1_ps(y.d), halves(&t.d))
    }
}

/// The 16 rows' Σ_j sc_j · Σ q·y over a staged grid tile: per 16 values, 4 dpbusd of the
/// biased activations (y + 128, unsigned) with the signed values, times the rows' scales; the
/// bias's term taken off once per block (|Σ| ≤ 256·255·62·31 < 2^31).
#[inline(always)]
unsafe fn isum_grid<const T: usize>(t: &TileGrid, ys: [&BlockQ8K; T]) -> [__m512i; T] {
    let mut total = [_mm512_setzero_si512(); T];
    for j in 0..16 {
        let mut part = [_mm512_setzero_si512(); T];
        for k in 0..4 {
            let w = load64(&t.q[4 * j + k]);
            for i in 0..T {
                part[i] = _mm512_dpbusd_epi32(part[i], bcast4(&ys[i].qs[16 * j + 4 * k..]), w);
            }
        }
        let sc = _mm512_cvtepi16_epi32(_mm256_loadu_si256(t.sc[j].as_ptr() as *const __m256i));
        for i in 0..T {
            total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(part[i], sc));
        }
    }
    let bias = _mm512_loadu_si512(t.bias.as_ptr() as *const __m512i);
    for s in total.iter_mut() {
        *s = _mm512_sub_epi32(*s, bias);
    }
    total
}

macro_rules! grid_tile_kernel {
    ($($f:ty),*) => {$(
        impl TileKernel for $f {
            #[inline(always)]
            unsafe fn isum<const T: usize>(
                t: &TileGrid,
                ys: [&BlockQ8K; T],
                _: [i32; T],
            ) -> [__m512i; T] {
                isum_grid(t, ys)
            }
            #[inline(always)]
            unsafe fn scale(t: &TileGrid, y: &BlockQ8K) -> __m512 {
                _mm512_mul_ps(_mm512_set1_ps(y.d), _mm512_loadu_ps(t.d.as_ptr()))
            }
        }
    )*};
}

grid_tile_kernel!(IQ2XXS, IQ2XS, IQ2S, IQ3XXS, IQ3S, IQ1S, IQ1M);

/// KVALUES + 128 (as u8, for dpbusd's unsigned operand) in each 128-bit lane.
#[inline(always)]
unsafe fn table_u8() -> __m512i {
    let t: [u8; 16] = KVALUES.map(|v| (v as i16 + 128) as u8);
    _mm512_broadcast_i32x4(load16(&t))
}

/// The 16 rows' Σ (KVALUES[q] + 128)·y over a 32-value group run of table indices (`qs[g]`:
/// values 8g..8g+8 of each row), added to `acc`.
#[inline(always)]
unsafe fn isum_table<const T: usize>(
    qs: &[[u8; 4 * TR]],
    y0: usize,
    ys: [&[i8]; T],
    mut acc: [__m512i; T],
) -> [__m512i; T] {
    let m4 = _mm512_set1_epi8(0x0F);
    let table = table_u8();
    for (g, group) in qs.iter().enumerate() {
        let w = load64(group);
        let lo = _mm512_shuffle_epi8(table, _mm512_and_si512(w, m4));
        let hi = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srli_epi16::<4>(w), m4));
        for i in 0..T {
            let y = &ys[i][y0 + 8 * g..];
            acc[i] = _mm512_dpbusd_epi32(acc[i], lo, bcast4(y));
            acc[i] = _mm512_dpbusd_epi32(acc[i], hi, bcast4(&y[4..]));
        }
    }
    acc
}

impl TileKernel for IQ4NL {
    #[inline(always)]
    unsafe fn isum<const T: usize>(
        t: &TileIQ4NL,
        ys: [&BlockQ8_0; T],
        ysums: [i32; T],
    ) -> [__m512i; T] {
        let zero = [_mm512_setzero_si512(); T];
        let acc = isum_table(&t.qs, 0, ys.map(|y| &y.qs[..]), zero);
        std::array::from_fn(|i| _mm512_sub_epi32(acc[i], _mm512_set1_epi32(ysums[i])))
    }
    #[inline(always)]
    unsafe fn scale(t: &TileIQ4NL, y: &BlockQ8_0) -> __m512 {
        _mm512_mul_ps(halves(&t.d), _mm512_set1_ps(y.d))
    }
}

impl TileKernel for IQ4XS {
    /// Per sub-block j: Σ (KVALUES[q] + 128)·y less 128 · (Σ of y over the sub-block), times
    /// the row's scale.
    #[inline(always)]
    unsafe fn isum<const T: usize>(t: &TileIQ4XS, ys: [&BlockQ8K; T], _: [i32; T]) -> [__m512i; T] {
        let mut total = [_mm512_setzero_si512(); T];
        for j in 0..8 {
            let zero = [_mm512_setzero_si512(); T];
            let qs = &t.qs[4 * j..4 * j + 4];
            let part = isum_table(qs, 32 * j, ys.map(|y| &y.qs[..]), zero);
            let sc = _mm512_cvtepi8_epi32(load16(&t.sc[j]));
            for i in 0..T {
                let s = ys[i].bsums[2 * j] as i32 + ys[i].bsums[2 * j + 1] as i32;
                let p = _mm512_sub_epi32(part[i], _mm512_set1_epi32(128 * s));
                total[i] = _mm512_add_epi32(total[i], _mm512_mullo_epi32(p, sc));
            }
        }
        total
    }
    #[inline(always)]
    unsafe fn scale(t: &TileIQ4XS, y: &BlockQ8K) -> __m512 {
        _mm512_mul_ps(_mm512_set1_ps(y.d), halves(&t.d))
    }
}

/// The 16 rows' dot products over all blocks with T activation rows (`ys[i]`, `ysums[i]` per
/// block), in [`dot_rows_scalar`]'s order.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
pub unsafe fn dot16<F: TileKernel, const T: usize>(
    tiles: &[F::Tile],
    ys: [&[F::Act]; T],
    ysums: [&[i32]; T],
) -> [[f32; TR]; T] {
    let mut acc = [_mm512_setzero_ps(); T];
    let mut summ = [_mm512_setzero_ps(); T];
    for (b, tile) in tiles.iter().enumerate() {
        let y: [&F::Act; T] = std::array::from_fn(|i| &ys[i][b]);
        let s: [i32; T] = std::array::from_fn(|i| if F::YSUM { ysums[i][b] } else { 0 });
        let isum = F::isum::<T>(tile, y, s);
        for i in 0..T {
            acc[i] = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(isum[i]),
                <F as TileKernel>::scale(tile, y[i]),
                acc[i],
            );
            if F::HAS_MIN {
                summ[i] = _mm512_add_ps(summ[i], <F as TileKernel>::min(tile, y[i]));
            }
        }
    }
    std::array::from_fn(|i| {
        let mut out = [0f32; TR];
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_add_ps(acc[i], summ[i]));
        out
    })
}
