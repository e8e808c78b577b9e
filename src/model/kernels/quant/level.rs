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
