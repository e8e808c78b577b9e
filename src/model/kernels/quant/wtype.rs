//! GGUF tensor types by ggml's ids (`ggml_type` in ggml.h), with each one's name, values per
//! block and bytes per block (ggml.c's `type_traits`): the file format's facts, for every type a
//! file may hold. The kernels' table, the GGUF reader and the error messages name types through
//! this, not through candle's `GgmlDType`, which knows only the types candle runs (a file holding
//! an i-quant is refused by candle's reader; kvchat reads it, see `model::gguf`).

use candle_core::quantized::GgmlDType;

/// A GGUF tensor type, by ggml's id.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WeightType(pub u32);

/// Every type ggml defines (retired ids left out): id, name, values per block, bytes per block,
/// and candle's name for it where candle's reader and QMatMul know it.
const TABLE: &[(u32, &str, usize, usize, Option<GgmlDType>)] = &[
    (0, "F32", 1, 4, Some(GgmlDType::F32)),
    (1, "F16", 1, 2, Some(GgmlDType::F16)),
    (2, "Q4_0", 32, 18, Some(GgmlDType::Q4_0)),
    (3, "Q4_1", 32, 20, Some(GgmlDType::Q4_1)),
    (6, "Q5_0", 32, 22, Some(GgmlDType::Q5_0)),
    (7, "Q5_1", 32, 24, Some(GgmlDType::Q5_1)),
    (8, "Q8_0", 32, 34, Some(GgmlDType::Q8_0)),
    (9, "Q8_1", 32, 36, Some(GgmlDType::Q8_1)),
    (10, "Q2_K", 256, 84, Some(GgmlDType::Q2K)),
    (11, "Q3_K", 256, 110, Some(GgmlDType::Q3K)),
    (12, "Q4_K", 256, 144, Some(GgmlDType::Q4K)),
    (13, "Q5_K", 256, 176, Some(GgmlDType::Q5K)),
    (14, "Q6_K", 256, 210, Some(GgmlDType::Q6K)),
    (15, "Q8_K", 256, 292, Some(GgmlDType::Q8K)),
    (16, "IQ2_XXS", 256, 66, None),
    (17, "IQ2_XS", 256, 74, None),
    (18, "IQ3_XXS", 256, 98, None),
    (19, "IQ1_S", 256, 50, None),
    (20, "IQ4_NL", 32, 18, None),
    (21, "IQ3_S", 256, 110, None),
    (22, "IQ2_S", 256, 82, None),
    (23, "IQ4_XS", 256, 136, None),
    (24, "I8", 1, 1, None),
    (25, "I16", 1, 2, None),
    (26, "I32", 1, 4, None),
    (27, "I64", 1, 8, None),
    (28, "F64", 1, 8, None),
    (29, "IQ1_M", 256, 56, None),
    (30, "BF16", 1, 2, Some(GgmlDType::BF16)),
    (34, "TQ1_0", 256, 54, None),
    (35, "TQ2_0", 256, 66, None),
    (39, "MXFP4", 32, 17, None),
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
    pub const MXFP4: Self = Self(39);

    fn row(self) -> Option<&'static (u32, &'static str, usize, usize, Option<GgmlDType>)> {
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
        self.row().and_then(|t| t.4)
    }

    /// The type candle calls `t`.
    pub fn from_candle(t: GgmlDType) -> Self {
        let row = TABLE.iter().find(|r| r.4 == Some(t));
        Self(row.expect("every candle type is a row of the table").0)
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
        for &(id, name, block, bytes, _) in TABLE {
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
