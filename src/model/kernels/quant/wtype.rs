//! GGUF tensor types by ggml's ids (`ggml_type` in ggml.h), with each one's name, values per
//! block and bytes per block (ggml.c's `type_traits`): the file format's facts, for every type a
//! file may hold. The kernels' table, the GGUF reader and the error messages name types through
//! this, not through candle's `GgmlDType`, which knows only the types candle runs (a file holding
//! an i-quant is refused by candle's reader; kvchat reads it, see `model::gguf`).

use candle_core::quantized::GgmlDType;

/// A GGUF tensor type, by ggml's id.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeightType(pub u32);

/// Every type ggml defines (retired ids left out): id, name, values per block, bytes per block.
const TABLE: &[(u32, &str, usize, usize)] = &[
    (0, "F32", 1, 4),
    (1, "F16", 1, 2),
    (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20),
    (6, "Q5_0", 32, 22),
    (7, "Q5_1", 32, 24),
    (8, "Q8_0", 32, 34),
    (9, "Q8_1", 32, 36),
    (10, "Q2_K", 256, 84),
    (11, "Q3_K", 256, 110),
    (12, "Q4_K", 256, 144),
    (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210),
    (15, "Q8_K", 256, 292),
    (16, "IQ2_XXS", 256, 66),
    (17, "IQ2_XS", 256, 74),
    (18, "IQ3_XXS", 256, 98),
    (19, "IQ1_S", 256, 50),
    (20, "IQ4_NL", 32, 18),
    (21, "IQ3_S", 256, 110),
    (22, "IQ2_S", 256, 82),
    (23, "IQ4_XS", 256, 136),
    (24, "I8", 1, 1),
    (25, "I16", 1, 2),
    (26, "I32", 1, 4),
    (27, "I64", 1, 8),
    (28, "F64", 1, 8),
    (29, "IQ1_M", 256, 56),
    (30, "BF16", 1, 2),
    (34, "TQ1_0", 256, 54),
    (35, "TQ2_0", 256, 66),
    (39, "MXFP4", 32, 17),
];

impl WeightType {
    pub const F32: Self = Self(0);
    pub const F16: Self = Self(1);
    pub const Q4_0: Self = Self(2);
    pub const Q4_1: Self = Self(3);
    pub const Q5_0: Self = Self(6);
    pub const Q5_1: Self = Self(7);
    pub const Q8_0: Self = Self(8);
    pub const Q2K: Self = Self(10);
    pub const Q3K: Self = Self(11);
    pub const Q4K: Self = Self(12);
    pub const Q5K: Self = Self(13);
    pub const Q6K: Self = Self(14);
    pub const IQ2_XXS: Self = Self(16);
    pub const IQ2_XS: Self = Self(17);
    pub const IQ3_XXS: Self = Self(18);
    pub const IQ1_S: Self = Self(19);
    pub const IQ4_NL: Self = Self(20);
    pub const IQ3_S: Self = Self(21);
    pub const IQ2_S: Self = Self(22);
    pub const IQ4_XS: Self = Self(23);
    pub const IQ1_M: Self = Self(29);
    pub const BF16: Self = Self(30);

    fn row(self) -> Option<&'static (u32, &'static str, usize, usize)> {
        TABLE.iter().find(|t| t.0 == self.0)
    }

    /// Whether ggml defines this id.
    pub fn known(self) -> bool {
        self.row().is_some()
    }

    /// ggml's name ("Q4_K"), or "type N" for an id ggml does not define.
    pub fn name(self) -> String {
        self.row()
            .map_or_else(|| format!("type {}", self.0), |t| t.1.to_string())
    }

    /// Values per block (1 for an unknown id: callers check `known` first).
    pub fn block_size(self) -> usize {
        self.row().map_or(1, |t| t.2)
    }

    /// Bytes per block (0 for an unknown id).
    pub fn type_size(self) -> usize {
        self.row().map_or(0, |t| t.3)
    }

    /// candle's name for this type, where candle's reader and QMatMul know it.
    pub fn candle(self) -> Option<GgmlDType> {
        use GgmlDType as G;
        Some(match self.0 {
            0 => G::F32,
            1 => G::F16,
            2 => G::Q4_0,
            3 => G::Q4_1,
            6 => G::Q5_0,
            7 => G::Q5_1,
            8 => G::Q8_0,
            9 => G::Q8_1,
            10 => G::Q2K,
            11 => G::Q3K,
            12 => G::Q4K,
            13 => G::Q5K,
            14 => G::Q6K,
            15 => G::Q8K,
            30 => G::BF16,
            _ => return None,
        })
    }

    /// The type candle calls `t`.
    pub fn from_candle(t: GgmlDType) -> Self {
        use GgmlDType as G;
        Self(match t {
            G::F32 => 0,
            G::F16 => 1,
            G::Q4_0 => 2,
            G::Q4_1 => 3,
            G::Q5_0 => 6,
            G::Q5_1 => 7,
            G::Q8_0 => 8,
            G::Q8_1 => 9,
            G::Q2K => 10,
            G::Q3K => 11,
            G::Q4K => 12,
            G::Q5K => 13,
            G::Q6K => 14,
            G::Q8K => 15,
            G::BF16 => 30,
        })
    }
}

impl std::fmt::Display for WeightType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

impl std::fmt::Debug for WeightType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_type_candle_knows_maps_back_to_itself_with_candles_block_sizes() {
        for &(id, name, block, bytes) in TABLE {
            let t = WeightType(id);
            if let Some(c) = t.candle() {
                assert_eq!(WeightType::from_candle(c), t, "{name}");
                assert_eq!((c.block_size(), c.type_size()), (block, bytes), "{name}");
            }
        }
        assert_eq!(WeightType::IQ4_XS.name(), "IQ4_XS");
        assert_eq!(WeightType(99).name(), "type 99");
        assert!(WeightType::IQ4_NL.candle().is_none());
    }
}
