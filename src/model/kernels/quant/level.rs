//! Which instruction set the kernels run: detected once, lowered by `KVCHAT_SIMD` for tests.

/// The instruction sets a kernel can use, best last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 (F, BW, VL) with VNNI, on top of AVX2.
    Vnni,
}

/// The best level this CPU runs, capped by `KVCHAT_SIMD=scalar|avx2|vnni` (for side-by-side
/// checks; the command line refuses other values, [`simd_cap`]); decided once per process.
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| {
        let cap = simd_cap().ok().flatten().unwrap_or(Level::Vnni);
        cap.min(detected())
    })
}

/// Whether this CPU's `vpgatherdd` beats scalar loads for the grid i-quants' lookups in a decode
/// step at the AVX-512 level: on Intel's AVX-512 cores it does (IQ3 decode 1.13× llama.cpp with
/// it, docs/perf-notes.md §17); AMD's Zen 4 runs gathers slowly (l1b-IQ3_XXS decode 57 ms/token
/// at the AVX-512 level with them, 39 at the AVX2 level with scalar loads, §22), as Zen 2 does
/// (§18). Decided once, from the CPU's vendor.
pub fn gathers_fast() -> bool {
    static FAST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *FAST.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            // The vendor string, 12 bytes in ebx, edx, ecx: "GenuineIntel".
            let r = std::arch::x86_64::__cpuid(0);
            [r.ebx, r.edx, r.ecx] == [0x756e_6547, 0x4965_6e69, 0x6c65_746e]
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// The cap `KVCHAT_SIMD` sets, if any; an error names a value that is not a level.
pub fn simd_cap() -> anyhow::Result<Option<Level>> {
    match std::env::var("KVCHAT_SIMD") {
        Err(_) => Ok(None),
        Ok(v) => match v.as_str() {
            "scalar" => Ok(Some(Level::Scalar)),
            "avx2" => Ok(Some(Level::Avx2)),
            "vnni" => Ok(Some(Level::Vnni)),
            other => anyhow::bail!("KVCHAT_SIMD='{other}' is not scalar, avx2 or vnni"),
        },
    }
}

/// The best level of this CPU.
pub(super) fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        if !(has!("avx2") && has!("fma") && has!("f16c")) {
            return Level::Scalar;
        }
        if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
            return Level::Vnni;
        }
        Level::Avx2
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        Level::Scalar
    }
}
