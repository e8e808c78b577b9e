//! `Packer`: a model's matrices read straight into their kernel layout (tiles or per row).

use super::*;
use anyhow::{bail, Context, Result};
use std::sync::Arc;

/// Reads a model's matrices for our kernels: those that become tiles into one [`TileArena`]
/// (huge pages, faulted once; q, k, v and gate, up end to end, so stacking them copies nothing),
/// the others per row. Each matrix is read straight into its layout, a few MiB at a time.
pub struct Packer {
    store: TileArena,
    /// The matrices told of, in order, with where each one's tiles go.
    plan: Vec<Planned>,
    /// How many of them `read` has been given.
    next: usize,
    slots: Vec<Slot>,
}

/// A matrix [`Packer::new`] was told of: its type and shape, and the first byte of its tiles in
/// the store (None: rows not in 16s, read on their own).
pub(super) struct Planned {
    dtype: WeightType,
    rows: usize,
    cols: usize,
    at: Option<usize>,
}

pub(super) enum Slot {
    Ready(QMatrix),
    Tiles {
        dtype: WeightType,
        rows: usize,
        cols: usize,
        at: usize,
    },
}

impl Packer {
    /// Room for the tiles of `mats` (`[dtype, rows, cols]` each, shapes already checked), read
    /// afterwards in this order.
    pub fn new(mats: &[(WeightType, usize, usize)]) -> Result<Self> {
        let mut end = 0usize;
        let plan: Vec<Planned> = mats
            .iter()
            .map(|&(dtype, rows, cols)| {
                let at = tileable(rows)
                    .then(|| {
                        tiled_format!(dtype, |F| {
                            let at = TiledMatrix::<F>::align(end);
                            end = at + TiledMatrix::<F>::bytes(rows, cols);
                            Some(at)
                        }, else None)
                    })
                    .flatten();
                Planned {
                    dtype,
                    rows,
                    cols,
                    at,
                }
            })
            .collect();
        let store = TileArena::zeroed(end)
            .with_context(|| format!("cannot allocate {end} bytes for the weights"))?;
        Ok(Self {
            store,
            plan,
            next: 0,
            slots: Vec::new(),
        })
    }

    /// Reads the next matrix, `[rows, cols]` GGUF blocks of `dtype` from `src`; it must be the
    /// next one [`Packer::new`] was told of. False (and nothing read) for a type this driver
    /// does not run.
    pub fn read(
        &mut self,
        dtype: WeightType,
        rows: usize,
        cols: usize,
        src: &mut dyn std::io::Read,
    ) -> Result<bool> {
        let told = self.plan.get(self.next);
        let Some(&Planned { at, .. }) =
            told.filter(|p| (p.dtype, p.rows, p.cols) == (dtype, rows, cols))
        else {
            bail!("{dtype:?} matrix [{rows}, {cols}] was not among those planned");
        };
        self.next += 1;
        if !FORMATS.contains(&dtype) {
            return Ok(false);
        }
        check_cols(dtype, cols)?;
        let slot = match at {
            Some(at) => tiled_format!(dtype, |F| {
                TiledMatrix::<F>::read_into(&mut self.store, at, rows, cols, src)?;
                Slot::Tiles { dtype, rows, cols, at }
            }, else unreachable!("only tiled types are planned a place")),
            None => match QMatrix::read_rows(dtype, rows, cols, src)? {
                Some(m) => Slot::Ready(m),
                None => return Ok(false),
            },
        };
        self.slots.push(slot);
        Ok(true)
    }

    /// The matrices read, in order.
    pub fn finish(self) -> Vec<QMatrix> {
        let store = Arc::new(self.store);
        self.slots
            .into_iter()
            .map(|slot| match slot {
                Slot::Ready(m) => m,
                Slot::Tiles {
                    dtype,
                    rows,
                    cols,
                    at,
                } => tiled_format!(dtype, |F| {
                    QMatrix::new(TiledMatrix::<F>::view(&store, at, rows, cols))
                }, else unreachable!("only tiled types are placed")),
            })
            .collect()
    }
}
