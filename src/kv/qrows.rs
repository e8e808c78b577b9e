//! INT8 and INT4 KV rows as tensors, for a cache whose rows live on a device (CUDA, Metal, or the
//! CPU running the GPU's path): the numbers of the CPU's row formats (`kvrows::Q8`, `kvrows::Q4`),
//! computed with candle ops where the rows are, so that nothing is sent to the CPU to be encoded or
//! decoded, and only the stored bytes cross between host and device when rows are offloaded.
//!
//! Shapes, for `n` positions of `nkv` heads of `hd` values, `g = hd / QK` groups a row:
//! - values: `[1, nkv, n, hd]` f32;
//! - quants `q`: INT8 `[1, nkv, n, hd]` u8 holding `q + 128` (q ∈ [−127, 127]); INT4
//!   `[1, nkv, n, hd / 2]` u8 in the codec's nibble order (group j's byte i holds value `32j + i`
//!   in its low nibble and `32j + i + 16` in its high one), each nibble `q + 8`;
//! - scales `d`: `[1, nkv, n, g]` f16.
//!
//! Encoding gives the codec's bytes, ties and signed zeros included (tested against it).

use crate::model::cache::{OnDevice, Precision, Quants};
use crate::model::kernels::kvrows::QK;
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use half::f16;

/// Quantized rows: quants and scales (shapes above).
#[derive(Clone)]
pub struct QRows {
    pub q: Tensor,
    pub d: Tensor,
}

/// How `p`'s quants are kept (the precision table's [`OnDevice::Quantized`]).
fn quants(p: Precision) -> Result<Quants> {
    match p.on_device() {
        OnDevice::Quantized(q) => Ok(q),
        OnDevice::Float(_) => bail!("{p:?} rows are not quantized"),
    }
}

/// Bytes of one row's quants.
pub fn quant_bytes(p: Precision, hd: usize) -> Result<usize> {
    Ok(match quants(p)? {
        Quants::Byte => hd,
        Quants::Nibble => hd / 2,
    })
}

/// `x` `[1, nkv, n, hd]` quantized where it lies.
pub fn encode(x: &Tensor, p: Precision) -> Result<QRows> {
    let (b, nkv, n, hd) = x.dims4()?;
    if hd % QK != 0 {
        bail!("head_dim {hd} is not a multiple of the {QK}-value groups of {p:?} rows");
    }
    let g = hd / QK;
    let dev = x.device();
    let x = x.to_dtype(DType::F32)?.reshape((b, nkv, n, g, QK))?; // [1, nkv, n, g, QK]
    let (d, lo, hi) = match quants(p)? {
        Quants::Byte => {
            let amax = x.abs()?.max_keepdim(4)?; // [1, nkv, n, g, 1]
                                                 // A division, as the codec does (candle's `/ f64` multiplies by the inverse).
            (
                amax.broadcast_div(&Tensor::new(127f32, dev)?)?,
                -127.0,
                127.0,
            )
        }
        Quants::Nibble => {
            // The value of largest magnitude, with its sign, maps to −8 exactly (ggml's q4_0); of
            // several, the first, as the codec's scan takes it: each one weighted by QK − j, the
            // largest weight is the first.
            let abs = x.abs()?;
            let at_max = abs
                .broadcast_eq(&abs.max_keepdim(4)?)?
                .to_dtype(DType::F32)?;
            let first_wins = Tensor::arange(0f32, QK as f32, dev)?.affine(-1.0, QK as f64)?;
            let j = at_max.broadcast_mul(&first_wins)?.argmax_keepdim(4)?; // [1, nkv, n, g, 1]
                                                                           // (+ 0 turns an all-zero group's −0 into the codec's +0.)
            let m = (x.contiguous()?.gather(&j, 4)? + 0.0)?;
            // Divided, not multiplied (candle's affine adds +0.0, which turns −0 into +0).
            (m.broadcast_div(&Tensor::new(-8f32, dev)?)?, -8.0, 7.0)
        }
    };
    let d = d.to_dtype(DType::F16)?; // [1, nkv, n, g, 1]
    let df = d.to_dtype(DType::F32)?;
    // A zero scale (an all-zero group) divides by 1 instead: every quotient is then 0, as the
    // codec's `q = 0` for such a group.
    let safe = (&df + df.eq(0f32)?.to_dtype(DType::F32)?)?;
    let q = x.broadcast_div(&safe)?.round()?.clamp(lo, hi)?; // [1, nkv, n, g, QK]
    let q = match quants(p)? {
        Quants::Byte => (q + 128.0)?.to_dtype(DType::U8)?.reshape((b, nkv, n, hd))?,
        Quants::Nibble => {
            let q = (q + 8.0)?;
            let (low, high) = (q.narrow(4, 0, QK / 2)?, q.narrow(4, QK / 2, QK / 2)?);
            (low + (high * 16.0)?)?
                .to_dtype(DType::U8)?
                .reshape((b, nkv, n, hd / 2))?
        }
    };
    Ok(QRows {
        q,
        d: d.reshape((b, nkv, n, g))?,
    })
}

/// The values `[1, nkv, n, hd]` f32 of quantized rows: `q·d`, one rounding, as the codec's decoders.
pub fn decode(r: &QRows, p: Precision) -> Result<Tensor> {
    let (b, nkv, n, g) = r.d.dims4()?;
    let q = r.q.to_dtype(DType::F32)?;
    let q = match quants(p)? {
        Quants::Byte => (q - 128.0)?.reshape((b, nkv, n, g, QK))?,
        Quants::Nibble => {
            let q = q.reshape((b, nkv, n, g, QK / 2))?;
            let high = (q.clone() * 0.0625)?.floor()?;
            let low = (q - (&high * 16.0)?)?;
            (Tensor::cat(&[low, high], 4)? - 8.0)?
        }
    };
    let d = r.d.to_dtype(DType::F32)?.unsqueeze(4)?; // [1, nkv, n, g, 1]
    Ok(q.broadcast_mul(&d)?.reshape((b, nkv, n, g * QK))?)
}

/// Rows in the codec's byte layout (`[nkv, n, row bytes]`: each row its quants, then its f16
/// scales little-endian), as a host store keeps them, put on `device`.
pub fn from_host(
    bytes: &[u8],
    p: Precision,
    (nkv, n, hd): (usize, usize, usize),
    device: &Device,
) -> Result<QRows> {
    let (qb, g) = (quant_bytes(p, hd)?, hd / QK);
    let byte = quants(p)? == Quants::Byte;
    let row = qb + 2 * g;
    if bytes.len() != nkv * n * row {
        bail!(
            "{} bytes are not {n} rows of {nkv} heads of {p:?} × {hd}",
            bytes.len()
        );
    }
    let mut q = Vec::with_capacity(nkv * n * qb);
    let mut d = Vec::with_capacity(nkv * n * g);
    for r in bytes.chunks_exact(row) {
        if byte {
            // The codec stores q as i8; the tensor as q + 128.
            q.extend(r[..qb].iter().map(|b| b ^ 0x80));
        } else {
            q.extend_from_slice(&r[..qb]);
        }
        d.extend(
            r[qb..]
                .chunks_exact(2)
                .map(|s| f16::from_le_bytes([s[0], s[1]])),
        );
    }
    Ok(QRows {
        q: Tensor::from_vec(q, (1, nkv, n, qb), device)?,
        d: Tensor::from_vec(d, (1, nkv, n, g), device)?,
    })
}

/// The rows in the codec's byte layout (the inverse of [`from_host`]).
pub fn to_host(r: &QRows, p: Precision) -> Result<Vec<u8>> {
    let (_, nkv, n, qb) = r.q.dims4()?;
    let g = r.d.dim(3)?;
    let q: Vec<u8> = r.q.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
    let d: Vec<f16> = r.d.to_device(&Device::Cpu)?.flatten_all()?.to_vec1()?;
    let byte = quants(p)? == Quants::Byte;
    let mut out = Vec::with_capacity(nkv * n * (qb + 2 * g));
    for (qs, ds) in q.chunks_exact(qb).zip(d.chunks_exact(g)) {
        if byte {
            out.extend(qs.iter().map(|b| b ^ 0x80));
        } else {
            out.extend_from_slice(qs);
        }
        for s in ds {
            out.extend_from_slice(&s.to_le_bytes());
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::kernels::kvrows::{self, Codec};

    const NKV: usize = 2;
    const N: usize = 5;
    const HD: usize = 64;

    /// Rows with outliers, an all-zero row and a row of values too small for an f16 scale.
    fn rows() -> (Tensor, Vec<f32>) {
        let mut xs: Vec<f32> = (0..NKV * N * HD)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * if i % 37 == 0 { 9.0 } else { 1.0 })
            .collect();
        xs[HD..2 * HD].fill(0.0);
        xs[2 * HD..3 * HD].iter_mut().for_each(|x| *x *= 1e-9);
        // Groups whose largest magnitudes tie: −2 before +2, then +3 before −3; and −0.
        xs[3 * HD..3 * HD + 32].fill(0.5);
        (xs[3 * HD + 4], xs[3 * HD + 9]) = (-2.0, 2.0);
        (xs[3 * HD + 32 + 1], xs[3 * HD + 32 + 30]) = (3.0, -3.0);
        xs[4 * HD..4 * HD + 32].fill(-0.0);
        let t = Tensor::from_vec(xs.clone(), (1, NKV, N, HD), &Device::Cpu).unwrap();
        (t, xs)
    }

    fn codec_bytes<C: Codec<E = u8>>(xs: &[f32]) -> Vec<u8> {
        let row = C::row_len(HD);
        let mut out = vec![0u8; xs.len() / HD * row];
        for (x, o) in xs.chunks_exact(HD).zip(out.chunks_exact_mut(row)) {
            C::encode(x, o);
        }
        out
    }

    fn codec_values<C: Codec<E = u8>>(bytes: &[u8]) -> Vec<f32> {
        let mut buf = vec![0f32; HD];
        bytes
            .chunks_exact(C::row_len(HD))
            .flat_map(|r| C::decode_scalar(r, &mut buf).to_vec())
            .collect()
    }

    #[test]
    fn int8_rows_encoded_as_tensors_are_the_codecs_bytes() {
        let (t, xs) = rows();
        let r = encode(&t, Precision::Int8).unwrap();
        assert_eq!(
            to_host(&r, Precision::Int8).unwrap(),
            codec_bytes::<kvrows::Q8>(&xs)
        );
    }

    #[test]
    fn int4_rows_encoded_as_tensors_are_the_codecs_bytes() {
        let (t, xs) = rows();
        let r = encode(&t, Precision::Int4).unwrap();
        assert_eq!(
            to_host(&r, Precision::Int4).unwrap(),
            codec_bytes::<kvrows::Q4>(&xs)
        );
    }

    #[test]
    fn decoded_tensor_rows_are_the_codecs_values_bit_for_bit() {
        let (_, xs) = rows();
        for (p, bytes, want) in [
            (
                Precision::Int8,
                codec_bytes::<kvrows::Q8>(&xs),
                codec_values::<kvrows::Q8>(&codec_bytes::<kvrows::Q8>(&xs)),
            ),
            (
                Precision::Int4,
                codec_bytes::<kvrows::Q4>(&xs),
                codec_values::<kvrows::Q4>(&codec_bytes::<kvrows::Q4>(&xs)),
            ),
        ] {
            let r = from_host(&bytes, p, (NKV, N, HD), &Device::Cpu).unwrap();
            let got: Vec<f32> = decode(&r, p)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{p:?}: tensor decode differs from the codec's");
        }
    }

    #[test]
    fn host_bytes_of_the_wrong_length_are_refused() {
        let err = from_host(&[0u8; 10], Precision::Int8, (NKV, N, HD), &Device::Cpu)
            .err()
            .unwrap();
        assert!(err.to_string().contains("10 bytes are not 5 rows"), "{err}");
    }
}
