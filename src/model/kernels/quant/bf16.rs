//! BF16 weights with BF16 activations, as llama.cpp pairs them (its `vec_dot_type` for BF16 is
//! BF16): each input row is rounded to BF16 once per matmul (to nearest, ties to even), and a row's
//! sum runs in the order of AVX-512 BF16's `vdpbf16ps`, which CPUs that have it (AMD Zen 4, Intel
//! from Cooper Lake) run natively, at twice the multiply-adds of an f32 FMA, and every other path
//! emulates to the same bits.
//!
//! **The summation order** (every path): a row is taken 32 elements at a time; elements `2l` and
//! `2l + 1` of each 32 go to accumulator `l` of 16, the odd one first, each product (exact in f32:
//! two 8-bit significands) added with one rounding. That is `vdpbf16ps`'s order in Intel's
//! manual, and what AMD's Zen 4 computes (3.2 million sums of random inputs, every bit equal; the
//! even-first order differed in 1.4 % of them). A row's tail past its last 32 takes the same
//! pairs (a missing odd element adds nothing). The 16 accumulators are then folded as the float
//! types fold theirs ([`super::floats`]): `a[l] + a[l + 8]`, then the 8 as [`super::hsum`] adds
//! them. Decode, prefill and every level sum alike, so they agree to the bit.
//!
//! `vdpbf16ps` flushes values below f32's normal range (|x| < 2⁻¹²⁶) to zero where the emulation
//! keeps them; no real weight, activation or partial sum lives there.
//!
//! The paths ([`Path`]): the scalar reference [`dot_ref`]; AVX2, which splits each 16 values
//! into their even and odd elements widened to f32 (a shift and a mask) and runs lanes 0–7 of
//! the accumulators on a 32's first half and 8–15 on its second; AVX-512, the same on one
//! register of 16; AVX-512 BF16, `vdpbf16ps` itself.

use super::{fold16 as fold, Level, RowFormat, WeightType};
use half::bf16;

/// Accumulators per row.
const L: usize = 16;
/// Elements per step: the pairs of one 16-lane register.
const STEP: usize = 2 * L;

/// Elements `from..` (`from` even) of a row and an activation row added into the accumulators in
/// the scalar order.
#[inline(always)]
fn accumulate(acc: &mut [f32; L], xs: &[bf16], ys: &[bf16], from: usize) {
    let n = xs.len().min(ys.len());
    let product = |i: usize, a: f32| xs[i].to_f32().mul_add(ys[i].to_f32(), a);
    for i in (from..n).step_by(2) {
        let l = (i % STEP) / 2;
        if i + 1 < n {
            acc[l] = product(i + 1, acc[l]);
        }
        acc[l] = product(i, acc[l]);
    }
}

/// The portable dot product of one BF16 weight row with one BF16 activation row: the reference
/// every other path is tested against, bit for bit.
pub fn dot_ref(xs: &[bf16], ys: &[bf16]) -> f32 {
    let mut acc = [0f32; L];
    accumulate(&mut acc, xs, ys, 0);
    fold(acc)
}

/// Which code sums a row (all give the same bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    Scalar,
    Avx2,
    /// AVX-512F, emulating `vdpbf16ps` with a shift, a mask and two FMAs.
    Avx512,
    /// AVX-512 BF16's `vdpbf16ps`.
    Avx512Bf16,
}

impl Path {
    /// The fastest path at `level` (never above what this CPU runs).
    pub fn at(level: Level) -> Path {
        match level.min(super::level()) {
            Level::Scalar => Path::Scalar,
            Level::Avx2 => Path::Avx2,
            Level::Vnni if native() => Path::Avx512Bf16,
            Level::Vnni => Path::Avx512,
        }
    }

    /// Every path this CPU runs, the reference first.
    #[cfg(test)]
    fn available() -> Vec<Path> {
        let all = [Path::Scalar, Path::Avx2, Path::Avx512, Path::Avx512Bf16];
        let best = Path::at(Level::Vnni);
        all.into_iter()
            .take_while(|&p| p != best)
            .chain([best])
            .collect()
    }

    /// Rows `xs` with tokens `ys`, `[row][token]`.
    fn sums<const R: usize, const T: usize>(
        self,
        xs: [&[bf16]; R],
        ys: [&[bf16]; T],
    ) -> [[f32; T]; R] {
        #[cfg(target_arch = "x86_64")]
        match self {
            // SAFETY (each arm): the path is one this CPU runs: `Path::at` gives no path above
            // `level()` (detected at run time) and `native()` (checked at run time), and a test
            // only asks for those `Path::available` lists.
            Path::Avx2 => return unsafe { avx2::sums(xs, ys) },
            Path::Avx512 => return unsafe { avx512::emulated(xs, ys) },
            Path::Avx512Bf16 => return unsafe { avx512::native(xs, ys) },
            Path::Scalar => {}
        }
        xs.map(|x| ys.map(|y| dot_ref(x, y)))
    }
}

/// Whether this CPU runs `vdpbf16ps` (and the AVX-512 level is not capped by `KVCHAT_SIMD`).
fn native() -> bool {
    static NATIVE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NATIVE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            super::level() >= Level::Vnni && std::arch::is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Each pair's 16 accumulators (`acc(row, token)`, holding the first `n − n % 32` elements), the
/// tail added and the accumulators folded as [`dot_ref`] does.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn finish<const R: usize, const T: usize>(
    acc: impl Fn(usize, usize) -> [f32; L],
    xs: [&[bf16]; R],
    ys: [&[bf16]; T],
    n: usize,
) -> [[f32; T]; R] {
    std::array::from_fn(|r| {
        std::array::from_fn(|t| {
            let mut a = acc(r, t);
            accumulate(&mut a, &xs[r][..n], &ys[t][..n], n - n % STEP);
            fold(a)
        })
    })
}

/// BF16 weights: the GGUF's values as stored, BF16 activations.
pub struct Bf16;

impl RowFormat for Bf16 {
    type Block = bf16;
    type Act = bf16;
    const N: usize = 1;
    const DTYPE: WeightType = WeightType::BF16;
    fn quantize(xs: &[f32], ys: &mut [bf16]) {
        ys.iter_mut()
            .zip(xs)
            .for_each(|(y, &x)| *y = bf16::from_f32(x));
    }
    fn dequantize(x: &bf16, out: &mut [f32]) {
        out[0] = x.to_f32();
    }
    #[inline]
    fn dot(level: Level, xs: &[bf16], ys: &[bf16]) -> f32 {
        Path::at(level).sums([xs], [ys])[0][0]
    }
    #[inline]
    fn dot_x4(level: Level, xs: &[bf16], ys: [&[bf16]; 4]) -> [f32; 4] {
        Path::at(level).sums([xs], ys)[0]
    }
    #[inline]
    fn dot_4x4(level: Level, xs: [&[bf16]; 4], ys: [&[bf16]; 4]) -> [[f32; 4]; 4] {
        Path::at(level).sums(xs, ys)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::super::{avx2::hsum_ps, shortest};
    use super::{bf16, finish, L, STEP};
    use std::arch::x86_64::*;

    /// 16 values at `p` as f32 lanes: (the even elements, the odd ones); lane `j` holds elements
    /// `2j` and `2j + 1`. A bf16 is the high half of its f32.
    #[inline(always)]
    unsafe fn split(p: *const bf16) -> (__m256, __m256) {
        let v = _mm256_loadu_si256(p as *const __m256i);
        let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
        (
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v)),
            _mm256_castsi256_ps(_mm256_and_si256(v, high)),
        )
    }

    /// One half of each 32 (the pointers start at it) for `steps` 32s: lanes `8h..8h + 8` of the
    /// accumulators of every (row, token) pair.
    ///
    /// # Safety
    /// AVX2 and FMA run; every pointer has `32·(steps − 1) + 16` values after it.
    #[inline(always)]
    unsafe fn half<const R: usize, const T: usize>(
        acc: &mut [[__m256; T]; R],
        x: [*const bf16; R],
        y: [*const bf16; T],
        steps: usize,
    ) {
        let mut a = *acc;
        for s in 0..steps {
            let o = s * STEP;
            let w: [(__m256, __m256); R] = std::array::from_fn(|r| split(x[r].add(o)));
            for t in 0..T {
                let (even, odd) = split(y[t].add(o));
                for r in 0..R {
                    a[r][t] = _mm256_fmadd_ps(w[r].1, odd, a[r][t]);
                    a[r][t] = _mm256_fmadd_ps(w[r].0, even, a[r][t]);
                }
            }
        }
        *acc = a;
    }

    /// Columns per block: four tokens' and four rows' 1,024 values (16 KiB) stay in L1 across the
    /// block's passes.
    const KC: usize = 1024;

    /// `R` rows with `T` tokens. The 16 accumulators of a pair take two registers, so each block
    /// of [`KC`] columns is walked once per half (lanes 0–7, then 8–15) and, for four rows, per
    /// pair of rows: at most 8 accumulators in registers. Each accumulator still takes its
    /// elements in increasing order, so the sums are [`super::dot_ref`]'s.
    ///
    /// # Safety
    /// AVX2 and FMA run.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn sums<const R: usize, const T: usize>(
        xs: [&[bf16]; R],
        ys: [&[bf16]; T],
    ) -> [[f32; T]; R] {
        let n = shortest(xs, ys);
        let body = n - n % STEP;
        // acc[half][row][token]: lanes 8·half..8·half + 8 of the 16.
        let mut acc = [[[_mm256_setzero_ps(); T]; R]; 2];
        // Rows per pass: 8 accumulators or fewer in registers.
        let per = if R * T > 8 { 2 } else { R };
        let mut c0 = 0;
        while c0 < body {
            let steps = (body - c0).min(KC) / STEP;
            for (h, acc) in acc.iter_mut().enumerate() {
                let at = c0 + 16 * h;
                let y: [*const bf16; T] = std::array::from_fn(|t| ys[t][at..].as_ptr());
                for r0 in (0..R).step_by(per) {
                    // SAFETY: the last value read is `at + 32·(steps − 1) + 15 = c0 + 16·h +
                    // 32·steps − 17 < c0 + 32·steps ≤ body ≤ n`, inside every row and token.
                    if per == 2 {
                        let mut two = [acc[r0], acc[r0 + 1]];
                        half::<2, T>(
                            &mut two,
                            [xs[r0][at..].as_ptr(), xs[r0 + 1][at..].as_ptr()],
                            y,
                            steps,
                        );
                        [acc[r0], acc[r0 + 1]] = two;
                    } else {
                        let x: [*const bf16; R] = std::array::from_fn(|r| xs[r][at..].as_ptr());
                        half::<R, T>(acc, x, y, steps);
                    }
                }
            }
            c0 += steps * STEP;
        }
        let mut sums = [[0f32; T]; R];
        if body == n {
            // No tail: folded in registers (a sixth of the kernel's time when spilled).
            for (r, sums) in sums.iter_mut().enumerate() {
                for (t, s) in sums.iter_mut().enumerate() {
                    *s = hsum_ps(_mm256_add_ps(acc[0][r][t], acc[1][r][t]));
                }
            }
            return sums;
        }
        // Spilled into an array of their own, as in `avx512::sums`.
        let mut spilled = [[[0f32; L]; T]; R];
        for (h, acc) in acc.iter().enumerate() {
            for (s, a) in spilled.iter_mut().zip(acc) {
                for (s, a) in s.iter_mut().zip(a) {
                    _mm256_storeu_ps(s[8 * h..].as_mut_ptr(), *a);
                }
            }
        }
        finish(|r, t| spilled[r][t], xs, ys, n)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::super::{avx2::hsum16_ps, shortest};
    use super::{bf16, finish, L, STEP};
    use std::arch::x86_64::*;

    /// How one register of 32 weights and one of 32 activations add into 16 accumulators.
    trait Pairs {
        /// A register of 32 values as the step takes it.
        type V: Copy;
        unsafe fn load(p: *const bf16) -> Self::V;
        unsafe fn add(acc: __m512, w: Self::V, y: Self::V) -> __m512;
    }

    /// `vdpbf16ps`'s sum with AVX-512F: the even and odd elements widened (a shift, a mask), the
    /// odd products added first.
    struct Emulated;
    impl Pairs for Emulated {
        type V = (__m512, __m512);
        #[inline(always)]
        unsafe fn load(p: *const bf16) -> Self::V {
            let v = _mm512_loadu_si512(p as *const _);
            let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
            (
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)),
                _mm512_castsi512_ps(_mm512_and_si512(v, high)),
            )
        }
        #[inline(always)]
        unsafe fn add(acc: __m512, w: Self::V, y: Self::V) -> __m512 {
            _mm512_fmadd_ps(w.0, y.0, _mm512_fmadd_ps(w.1, y.1, acc))
        }
    }

    /// `vdpbf16ps` itself.
    struct Native;
    impl Pairs for Native {
        type V = __m512bh;
        #[inline(always)]
        unsafe fn load(p: *const bf16) -> Self::V {
            // SAFETY: 32 bf16 values are 512 bits, as the register is.
            std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const _))
        }
        #[inline(always)]
        unsafe fn add(acc: __m512, w: Self::V, y: Self::V) -> __m512 {
            _mm512_dpbf16_ps(acc, w, y)
        }
    }

    /// Bytes ahead of its read that a decode row (one row, one token) asks L1 for: a row of a
    /// 2048-column matrix is one 4 KiB page, where the hardware prefetcher stops and starts cold
    /// again. l1b-BF16 decode at 128 (`kvchat bench --contexts 128 --gen 32 --repeat 2`),
    /// alternating, Intel Xeon with AVX-512 BF16, 2026-12-05: 99.4 / 99.9 / 99.2 ms/token
    /// without, 86.5 / 82.1 / 85.0 with (1, 4 and 8 KiB ahead measured alike).
    const AHEAD: usize = 2048;

    /// `R` rows with `T` tokens, 32 columns a step, one register of 16 accumulators a pair (16
    /// for four rows by four tokens, of the 32 registers).
    ///
    /// # Safety
    /// AVX-512F runs, and AVX-512 BF16 where `P` is [`Native`].
    #[inline(always)]
    unsafe fn sums<P: Pairs, const R: usize, const T: usize>(
        xs: [&[bf16]; R],
        ys: [&[bf16]; T],
    ) -> [[f32; T]; R] {
        let n = shortest(xs, ys);
        let body = n - n % STEP;
        let mut a = [[_mm512_setzero_ps(); T]; R];
        for c in (0..body).step_by(STEP) {
            if R == 1 && T == 1 {
                // A hint: any address is allowed (one past the matrix loads nothing).
                let p = xs[0].as_ptr().wrapping_add(c) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD));
            }
            // SAFETY: `c + 32 ≤ body ≤ n`, inside every row and token.
            let w: [P::V; R] = std::array::from_fn(|r| P::load(xs[r][c..].as_ptr()));
            for t in 0..T {
                let y = P::load(ys[t][c..].as_ptr());
                for r in 0..R {
                    a[r][t] = P::add(a[r][t], w[r], y);
                }
            }
        }
        if body == n {
            // No tail (every real model's rows): folded in registers, where spilling and
            // folding 16 sums as scalars took a sixth of the kernel's time.
            let mut sums = [[0f32; T]; R];
            for (s, a) in sums.iter_mut().zip(&a) {
                for (s, a) in s.iter_mut().zip(a) {
                    *s = hsum16_ps(*a);
                }
            }
            return sums;
        }
        // Spilled into an array of their own: a closure that read `a` would keep the registers
        // stored to memory at every step (it measured half the kernel's time).
        let mut spilled = [[[0f32; L]; T]; R];
        for (s, a) in spilled.iter_mut().zip(&a) {
            for (s, a) in s.iter_mut().zip(a) {
                _mm512_storeu_ps(s.as_mut_ptr(), *a);
            }
        }
        finish(|r, t| spilled[r][t], xs, ys, n)
    }

    /// # Safety
    /// AVX-512F runs.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma")]
    pub(super) unsafe fn emulated<const R: usize, const T: usize>(
        xs: [&[bf16]; R],
        ys: [&[bf16]; T],
    ) -> [[f32; T]; R] {
        sums::<Emulated, R, T>(xs, ys)
    }

    /// # Safety
    /// AVX-512F and AVX-512 BF16 run.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16,fma")]
    pub(super) unsafe fn native<const R: usize, const T: usize>(
        xs: [&[bf16]; R],
        ys: [&[bf16]; T],
    ) -> [[f32; T]; R] {
        sums::<Native, R, T>(xs, ys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A row of `n` BF16 values of magnitudes 2⁻¹⁴…2¹⁴, and four of activations in ±3.
    fn inputs(n: usize, seed: u64) -> (Vec<bf16>, Vec<Vec<bf16>>) {
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        let w = (0..n)
            .map(|_| r.random_range(-1.0f32..1.0) * 2f32.powi(r.random_range(-14..15)))
            .map(bf16::from_f32)
            .collect();
        let ys = (0..4)
            .map(|_| {
                (0..n)
                    .map(|_| bf16::from_f32(r.random_range(-3f32..3.0)))
                    .collect()
            })
            .collect();
        (w, ys)
    }

    #[test]
    fn every_path_equals_the_scalar_reference_bit_for_bit() {
        // 2080: more than two 1,024-column blocks of the AVX2 kernel, and a tail of 32; 87 and
        // 1111 end in a pair with no odd element.
        for n in [32, 87, 576, 1111, 2080] {
            let (w, ys) = inputs(n, n as u64);
            // Four rows: the row and three scaled copies.
            let rows: Vec<Vec<bf16>> = (1..=4)
                .map(|i| {
                    w.iter()
                        .map(|v| bf16::from_f32(v.to_f32() * i as f32))
                        .collect()
                })
                .collect();
            let y4 = [&ys[0][..], &ys[1], &ys[2], &ys[3]];
            let x4 = [&rows[0][..], &rows[1], &rows[2], &rows[3]];
            for path in Path::available() {
                let m4 = path.sums(x4, y4);
                let one_row = path.sums([&w[..]], y4)[0];
                for (t, y) in ys.iter().enumerate() {
                    let reference = dot_ref(&w, y);
                    let one = path.sums([&w[..]], [&y[..]])[0][0];
                    assert_eq!(one.to_bits(), reference.to_bits(), "{path:?} n={n} t={t}");
                    assert_eq!(one_row[t].to_bits(), reference.to_bits(), "{path:?} x4");
                    for (i, row) in rows.iter().enumerate() {
                        let reference = dot_ref(row, y).to_bits();
                        assert_eq!(m4[i][t].to_bits(), reference, "{path:?} 4x4 {i} {t}");
                    }
                }
            }
        }
    }

    #[test]
    fn the_reference_is_the_exact_product_to_f32_rounding() {
        for n in [87, 2080] {
            let (w, ys) = inputs(n, 7);
            let products = || w.iter().zip(&ys[0]).map(|(a, b)| a.to_f64() * b.to_f64());
            let exact: f64 = products().sum();
            let norm: f64 = products().map(f64::abs).sum();
            let got = dot_ref(&w, &ys[0]) as f64;
            assert!(
                (got - exact).abs() <= 1e-5 * norm,
                "n={n}: {got} vs {exact}"
            );
        }
    }

    /// Accumulator 0 holds 1 after the first 32; the second 32 brings it −1 (element 33, odd)
    /// and 3·2⁻²⁴ (element 32, even). Odd first, as `vdpbf16ps` adds: 1 − 1 + 3·2⁻²⁴ = 3·2⁻²⁴.
    /// Even first, 1 + 3·2⁻²⁴ would round to 1 + 2⁻²² and leave 2⁻²².
    #[test]
    fn each_pair_adds_its_odd_product_first_on_every_path() {
        let mut w = [bf16::ZERO; 64];
        (w[0], w[32], w[33]) = (
            bf16::ONE,
            bf16::from_f32(3.0 * 2f32.powi(-24)),
            bf16::NEG_ONE,
        );
        let y = [bf16::ONE; 64];
        for path in Path::available() {
            assert_eq!(
                path.sums([&w[..]], [&y[..]])[0][0],
                3.0 * 2f32.powi(-24),
                "{path:?}"
            );
        }
    }

    #[test]
    fn activations_round_to_the_nearest_bf16() {
        let mut ys = [bf16::ZERO; 3];
        // 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷: ties go to the even one, 1.
        Bf16::quantize(
            &[1.0 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-9), -2.5],
            &mut ys,
        );
        assert_eq!(ys.map(|y| y.to_f32()), [1.0, 1.0 + 2f32.powi(-7), -2.5]);
    }
}
