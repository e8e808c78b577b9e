//! CPU matrix kernels for GGUF quantized weights: one driver, one dot product per block format.
//!
//! As in llama.cpp's ggml-cpu, each weight format pairs with an activation format (`Act`): the f32
//! input rows are quantized once per matmul (Q8_0 for Q4_0/Q5_0/Q8_0, Q8_1 for Q4_1/Q5_1, Q8_K for
//! the K-quants), and a row of the output is a sum of block dot products. A format states (trait
//! [`Format`]) its block layout, how to dequantize a block, and per block the exact integer dot
//! product in 8 lanes with the float scale it is multiplied by; [`dot_scalar`] sums those the one
//! way every path sums them, and the AVX2 paths (module `avx2` of each format file, and the driver's
//! [`avx2`]) reproduce that sum bit for bit (tested, per format).
//!
//! **The summation order** (the same for every format and path): lane `l` of a block holds the
//! integer sum over its elements `i` with `(i % 32) / 4 == l` — what AVX2's maddubs+madd leave in
//! lane `l` — of `w_i · y_i` (w_i the integer weight, times its sub-block scale for K-quants). Each
//! lane is converted to f32 and fused-multiply-added with the block's scale into its own
//! accumulator; a format with a min term (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K) adds it to a separate f32 sum;
//! at the end the 8 lanes are added pairwise, ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), then the min
//! sum. Decode (one token) and prefill (four tokens per unpacked block) sum identically, so a
//! prefill, a decode and a `--no-cache` recompute agree to the bit.
//!
//! Where AVX2 runs and a matrix's rows come in 16s (every real model's), its blocks are
//! interleaved at load into 16-row tiles ([`tiled`]: one VNNI `dpbusd`, or AVX2's
//! `maddubs`+`madd`, serves 8 or 16 rows; one FMA a block of 8 or 16 rows) with their own, simpler
//! summation order (one accumulator per row; the reference is [`dot_rows_scalar`]); elsewhere
//! (rows not in 16s, or a type with no tiles: the grid i-quants) the per-row layout and the 8-lane
//! order above run. The float types (F32, F16: [`floats`]; BF16: [`bf16`]) run per row with their own
//! orders.
//!
//! Work is split over candle's own barrier pool (as candle splits its matmuls: no second thread
//! pool competing with its spinning workers; packing tiles at load uses scoped threads). Weights
//! this driver runs are kept once (the GGUF blocks, or the tiles that replace them); stacked
//! matrices (q/k/v, gate/up) share one store.

//!
//! Files: `act` (activation formats), `level` (SIMD level), `row` (per-row dot products),
//! `matrix` (the per-row matrix), `pack` (reading a model's matrices into tiles or rows),
//! `qmatrix` (the matrix of any format, and the kernel choice), `wtype` (ggml's types); one file
//! per block family (`legacy`, `kquants`, `iquants`, `iqgrid` with its `grids`, `floats`, `bf16`) and the
//! tiles (`tiled`). The table of weight types is below.

mod act;
pub(crate) mod bf16;
pub(crate) mod floats;
mod grids;
mod iqgrid;
mod iquants;
mod kquants;
mod legacy;
mod level;
mod matrix;
mod row;
mod tiled;
mod wtype;

use super::disjoint::DisjointOut;
use anyhow::Result;
use bytemuck::Pod;
use half::f16;
pub use wtype::WeightType;

pub use bf16::Bf16;
pub use floats::{dot_ref, Floats};
pub use iqgrid::{IQ1M, IQ1S, IQ2S, IQ2XS, IQ2XXS, IQ3S, IQ3XXS};
pub use iquants::{IQ4NL, IQ4XS, MXFP4};
pub use kquants::{Q2K, Q3K, Q4K, Q5K, Q6K};
pub use legacy::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use tiled::TileArena;
pub use tiled::{dot_rows_scalar, Tiled, TiledMatrix};

pub use act::*;
pub use level::*;
pub use matrix::*;
#[cfg(target_arch = "x86_64")]
use row::avx2;
pub use row::*;

/// An activation block format: how an f32 input row is quantized before the dot products.
pub trait Act: Pod + Send + Sync {
    /// Values per block.
    const N: usize;
    fn quantize(xs: &[f32], ys: &mut [Self]);
}

/// A weight block format. `Block` is the GGUF block, byte for byte.
pub trait Format: Send + Sync + 'static {
    type Block: Pod + Send + Sync;
    type Act: Act;
    /// Values per block (32, or 256 for the K-quants); `Act::N` is the same.
    const N: usize;
    const DTYPE: WeightType;
    /// Whether the format has a min term (`min_term` is not zero).
    const HAS_MIN: bool;
    /// The block's `N` weights as f32 (GGUF's dequantization).
    fn dequantize(x: &Self::Block, out: &mut [f32]);
    /// The 8 integer lanes of the block's dot product with `y` (see the module's summation order).
    fn lanes(x: &Self::Block, y: &Self::Act) -> [i32; 8];
    /// The float factor of the block's lanes.
    fn scale(x: &Self::Block, y: &Self::Act) -> f32;
    /// The block's min term (0 where `HAS_MIN` is false).
    fn min_term(x: &Self::Block, y: &Self::Act) -> f32;
}

/// The 8 lane accumulators added in the fixed order every path uses.
#[inline(always)]
fn hsum(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// The 16 accumulators of a float row (F32, F16, BF16) folded in the one order: `a[l] + a[l + 8]`,
/// then the 8 as [`hsum`] adds them.
#[inline(always)]
fn fold16(acc: [f32; 16]) -> f32 {
    hsum(std::array::from_fn(|l| acc[l] + acc[l + 8]))
}

/// The shortest of `R` rows and `T` activation rows (a float row kernel's length).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn shortest<A, B, const R: usize, const T: usize>(xs: [&[A]; R], ys: [&[B]; T]) -> usize {
    let rows = xs.iter().map(|x| x.len());
    ys.iter().map(|y| y.len()).chain(rows).min().unwrap_or(0)
}

/// The portable dot product of one weight row with one activation row: the reference every SIMD
/// path is tested against, bit for bit.
pub fn dot_scalar<F: Format>(xs: &[F::Block], ys: &[F::Act]) -> f32 {
    let mut acc = [0f32; 8];
    let mut summ = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let lanes = F::lanes(x, y);
        let d = F::scale(x, y);
        for (a, l) in acc.iter_mut().zip(lanes) {
            *a = (l as f32).mul_add(d, *a);
        }
        if F::HAS_MIN {
            summ += F::min_term(x, y);
        }
    }
    hsum(acc) + summ
}

/// The lane of element `i` of a block (see the module's summation order).
#[inline(always)]
fn lane(i: usize) -> usize {
    (i % 32) / 4
}

/// The weight types this driver runs, declared once. A row: ggml's type id, its name, its
/// [`WeightType`] const, and its format here (a block struct with `Format` and, for tiles, `Tiled`
/// impls; or `Floats<E>`). Rows under `tiled` become row-interleaved tiles at load where AVX2 runs
/// and rows come in 16s (per row otherwise); rows under `staged` keep their blocks per row and
/// are staged into tiles during each matmul (`staged`: the grid i-quants, whose unpacked form is
/// too large to store); rows under `per_row` always run per row. From these rows come
/// [`FORMATS`], [`WEIGHT_TYPES`] (the GGUF reader's list of what kvchat runs), the per-row reader
/// and `tiled_format!`. A new type: its kernel file and one row (docs/architecture.md).
macro_rules! weight_types {
    ($d:tt
        tiled { $($tid:literal $tname:literal $tdt:ident => $TF:ty;)* }
        staged { $($sid:literal $sname:literal $sdt:ident => $SF:ty;)* }
        per_row { $($rid:literal $rname:literal $rdt:ident => $RF:ty;)* }
    ) => {
        /// Runs `$body` with `$F` the format of a tiled `$dtype`; `$none` for other types.
        macro_rules! tiled_format {
            ($d dtype:expr, |$d F:ident| $d body:expr, else $d none:expr) => {
                match $d dtype {
                    $( WeightType::$tdt => {
                        #[allow(dead_code)]
                        type $d F = $TF;
                        $d body
                    } )*
                    _ => $d none,
                }
            };
        }

        /// The GGUF types this driver runs.
        pub const FORMATS: [WeightType; [$($tname,)* $($sname,)* $($rname,)*].len()] =
            [$(WeightType::$tdt,)* $(WeightType::$sdt,)* $(WeightType::$rdt,)*];

        /// The GGUF types this driver runs, as (ggml type id, name, candle's type).
        pub const WEIGHT_TYPES: [(u32, &str, WeightType); [$($tname,)* $($sname,)* $($rname,)*].len()] =
            [$(($tid, $tname, WeightType::$tdt),)* $(($sid, $sname, WeightType::$sdt),)*
             $(($rid, $rname, WeightType::$rdt),)*];

        /// The per-row matrix of `[rows, cols]` blocks of `dtype` read from `src`; None for a
        /// type this driver does not run.
        fn read_per_row(
            dtype: WeightType,
            rows: usize,
            cols: usize,
            src: &mut dyn std::io::Read,
        ) -> Result<Option<QMatrix>> {
            Ok(Some(match dtype {
                $( WeightType::$tdt => QMatrix::new(Matrix::<$TF>::read_rows(rows, cols, src)?), )*
                $( WeightType::$sdt => {
                    QMatrix::new(staged::Staged(Matrix::<$SF>::read_rows(rows, cols, src)?))
                } )*
                $( WeightType::$rdt => QMatrix::new(Matrix::<$RF>::read_rows(rows, cols, src)?), )*
                _ => return Ok(None),
            }))
        }
    };
}

weight_types! {$
    tiled {
        2 "Q4_0" Q4_0 => Q4_0;
        3 "Q4_1" Q4_1 => Q4_1;
        6 "Q5_0" Q5_0 => Q5_0;
        7 "Q5_1" Q5_1 => Q5_1;
        8 "Q8_0" Q8_0 => Q8_0;
        12 "Q4_K" Q4K => Q4K;
        13 "Q5_K" Q5K => Q5K;
        14 "Q6_K" Q6K => Q6K;
        10 "Q2_K" Q2K => Q2K;
        11 "Q3_K" Q3K => Q3K;
        20 "IQ4_NL" IQ4_NL => IQ4NL;
        23 "IQ4_XS" IQ4_XS => IQ4XS;
    }
    staged {
        16 "IQ2_XXS" IQ2_XXS => IQ2XXS;
        17 "IQ2_XS" IQ2_XS => IQ2XS;
        22 "IQ2_S" IQ2_S => IQ2S;
        18 "IQ3_XXS" IQ3_XXS => IQ3XXS;
        21 "IQ3_S" IQ3_S => IQ3S;
        19 "IQ1_S" IQ1_S => IQ1S;
        29 "IQ1_M" IQ1_M => IQ1M;
    }
    per_row {
        39 "MXFP4" MXFP4 => MXFP4;
        0 "F32" F32 => Floats<f32>;
        1 "F16" F16 => Floats<f16>;
        30 "BF16" BF16 => Bf16;
    }
}

// After the table: these use its `tiled_format!`.
mod pack;
mod qmatrix;
mod staged;
pub use pack::*;
pub use qmatrix::*;

#[cfg(test)]
mod tests;
