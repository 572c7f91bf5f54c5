//! Personalised exchanges: `all_to_all_single` (one buffer, optional uneven splits),
//! `all_to_all` (a list of blocks per rank), and `all_gather_list` (the list form of
//! all_gather, blocks of any length per rank), each with an async form.
use super::{Call, ProcessGroup};
use crate::element::Element;
use crate::error::CommError;
use crate::order::Ticket;
use crate::work::Work;

/// Element counts per rank of a buffer of `len`: the given split sizes (one per rank, summing
/// to `len`) or, without them, `len` split evenly (PyTorch's rule: it must divide).
fn split_sizes(
    which: &str,
    given: Option<&[usize]>,
    len: usize,
    n: usize,
) -> Result<Vec<usize>, CommError> {
    match given {
        Some(s) if s.len() != n => Err(CommError::invalid(
            "all_to_all_single",
            format!("{which}_split_sizes has {} entries for a group of {n} ranks", s.len()),
        )),
        Some(s) if s.iter().sum::<usize>() != len => Err(CommError::invalid(
            "all_to_all_single",
            format!(
                "{which}_split_sizes sum to {}, but the {which} has {len} elements",
                s.iter().sum::<usize>()
            ),
        )),
        Some(s) => Ok(s.to_vec()),
        None if !len.is_multiple_of(n) => Err(CommError::invalid(
            "all_to_all_single",
            format!(
                "the {which} has {len} elements, which {n} ranks cannot split evenly: pass \
                 {which}_split_sizes"
            ),
        )),
        None => Ok(vec![len / n; n]),
    }
}

/// Consecutive pieces of `buf` of `counts` elements each.
fn pieces<'a, T>(buf: &'a [T], counts: &[usize]) -> Vec<&'a [u8]>
where
    T: Element,
{
    let mut rest = buf;
    counts
        .iter()
        .map(|&c| {
            let (head, tail) = rest.split_at(c);
            rest = tail;
            bytemuck::cast_slice(head)
        })
        .collect()
}

fn pieces_mut<'a, T: Element>(buf: &'a mut [T], counts: &[usize]) -> Vec<&'a mut [u8]> {
    let mut rest = buf;
    counts
        .iter()
        .map(|&c| {
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(c);
            rest = tail;
            bytemuck::cast_slice_mut(head)
        })
        .collect()
}

fn check_list_len(op: &'static str, which: &str, got: usize, n: usize) -> Result<(), CommError> {
    if got != n {
        return Err(CommError::invalid(
            op,
            format!("{which} has {got} blocks for a group of {n} ranks (one per rank)"),
        ));
    }
    Ok(())
}

/// A rank's block to itself is copied locally: both sides of it are this rank's arguments.
fn check_own_block(
    op: &'static str,
    me: usize,
    sent: usize,
    expected: usize,
) -> Result<(), CommError> {
    if sent != expected {
        return Err(CommError::invalid(
            op,
            format!(
                "rank {me} sends {sent} elements to itself but expects {expected} from itself \
                 (input and output splits at index {me} differ)"
            ),
        ));
    }
    Ok(())
}

impl ProcessGroup {
    /// Rank r sends `input`'s j-th piece to rank j, which stores it as the r-th piece of its
    /// `output` (PyTorch's `all_to_all_single`). Pieces are `input_splits` / `output_splits`
    /// elements long, or equal without them; rank r's `input_splits[j]` must equal rank j's
    /// `output_splits[r]` (checked: a mismatch fails naming both ranks).
    pub fn all_to_all_single<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        input_splits: Option<&[usize]>,
        output_splits: Option<&[usize]>,
    ) -> Result<(), CommError> {
        self.all_to_all_single_ticket(self.ticket(), input, output, input_splits, output_splits)
    }

    fn all_to_all_single_ticket<T: Element>(
        &self,
        ticket: Ticket,
        input: &[T],
        output: &mut [T],
        input_splits: Option<&[usize]>,
        output_splits: Option<&[usize]>,
    ) -> Result<(), CommError> {
        let n = self.size();
        let ins = split_sizes("input", input_splits, input.len(), n)?;
        let outs = split_sizes("output", output_splits, output.len(), n)?;
        check_own_block("all_to_all_single", self.rank(), ins[self.rank()], outs[self.rank()])?;
        let send = pieces(input, &ins);
        let mut recv = pieces_mut(output, &outs);
        // Counts legitimately differ by rank: each round checks them pairwise instead.
        let call = Call::new("all_to_all", Some(T::DTYPE), 0, 0);
        let elem = std::mem::size_of::<T>();
        self.collective(ticket, call, |c| c.all_to_all(&send, &mut recv, elem))
    }

    /// [`ProcessGroup::all_to_all_single`] in the background; `wait()` returns `output`.
    pub fn all_to_all_single_async<T: Element>(
        &self,
        input: Vec<T>,
        mut output: Vec<T>,
        input_splits: Option<Vec<usize>>,
        output_splits: Option<Vec<usize>>,
    ) -> Work<Vec<T>> {
        self.spawn_ordered("all_to_all", move |pg, ticket| {
            pg.all_to_all_single_ticket(
                ticket,
                &input,
                &mut output,
                input_splits.as_deref(),
                output_splits.as_deref(),
            )?;
            Ok(output)
        })
    }

    /// Rank r sends `inputs[j]` to rank j, which receives it into its `outputs[r]` (PyTorch's
    /// `all_to_all`); blocks may have any length, as long as each pair of ranks agrees.
    pub fn all_to_all<T: Element>(
        &self,
        inputs: &[impl AsRef<[T]>],
        outputs: &mut [impl AsMut<[T]>],
    ) -> Result<(), CommError> {
        self.all_to_all_ticket(self.ticket(), inputs, outputs)
    }

    fn all_to_all_ticket<T: Element>(
        &self,
        ticket: Ticket,
        inputs: &[impl AsRef<[T]>],
        outputs: &mut [impl AsMut<[T]>],
    ) -> Result<(), CommError> {
        let n = self.size();
        check_list_len("all_to_all", "inputs", inputs.len(), n)?;
        check_list_len("all_to_all", "outputs", outputs.len(), n)?;
        let me = self.rank();
        check_own_block("all_to_all", me, inputs[me].as_ref().len(), outputs[me].as_mut().len())?;
        let send: Vec<&[u8]> = inputs.iter().map(|b| bytemuck::cast_slice(b.as_ref())).collect();
        let mut recv: Vec<&mut [u8]> =
            outputs.iter_mut().map(|b| bytemuck::cast_slice_mut(b.as_mut())).collect();
        let call = Call::new("all_to_all", Some(T::DTYPE), 0, 0);
        let elem = std::mem::size_of::<T>();
        self.collective(ticket, call, |c| c.all_to_all(&send, &mut recv, elem))
    }

    /// [`ProcessGroup::all_to_all`] in the background; `wait()` returns `outputs`.
    pub fn all_to_all_async<T: Element>(
        &self,
        inputs: Vec<Vec<T>>,
        mut outputs: Vec<Vec<T>>,
    ) -> Work<Vec<Vec<T>>> {
        self.spawn_ordered("all_to_all", move |pg, ticket| {
            pg.all_to_all_ticket(ticket, &inputs, &mut outputs)?;
            Ok(outputs)
        })
    }

    /// `outputs[r]` receives rank r's `input` (PyTorch's list form of `all_gather`). Unlike
    /// gloo, ranks may contribute different lengths: `outputs[r].len()` states rank r's, and
    /// every rank's lengths are checked against what the others send before any data moves.
    pub fn all_gather_list<T: Element>(
        &self,
        input: &[T],
        outputs: &mut [impl AsMut<[T]>],
    ) -> Result<(), CommError> {
        self.all_gather_list_ticket(self.ticket(), input, outputs)
    }

    fn all_gather_list_ticket<T: Element>(
        &self,
        ticket: Ticket,
        input: &[T],
        outputs: &mut [impl AsMut<[T]>],
    ) -> Result<(), CommError> {
        let (n, me) = (self.size(), self.rank());
        check_list_len("all_gather_list", "outputs", outputs.len(), n)?;
        let mine = outputs[me].as_mut().len();
        if mine != input.len() {
            return Err(CommError::invalid(
                "all_gather_list",
                format!("outputs[{me}] (this rank's) has {mine} elements, input {}", input.len()),
            ));
        }
        let lens: Vec<usize> = outputs.iter_mut().map(|o| o.as_mut().len()).collect();
        let es = std::mem::size_of::<T>();
        let at = crate::collectives::ranges(&lens, es);
        let mut all = vec![0u8; at.last().map_or(0, |r| r.end)];
        all[at[me].clone()].copy_from_slice(bytemuck::cast_slice(input));
        let call = Call::new("all_gather_list", Some(T::DTYPE), 0, 0);
        let world = self.inner.world_ranks.clone();
        self.collective(ticket, call, |c| {
            let mut announced = vec![0u8; 8 * n];
            announced[8 * me..8 * me + 8].copy_from_slice(&(input.len() as u64).to_le_bytes());
            let at8: Vec<_> = (0..n).map(|r| 8 * r..8 * r + 8).collect();
            c.all_gather_blocks(&mut announced, &at8)?;
            for (r, b) in announced.chunks_exact(8).enumerate() {
                let theirs = u64::from_le_bytes(b.try_into().unwrap_or([0; 8]));
                if theirs != lens[r] as u64 {
                    return Err(crate::transport::PeerError {
                        peer: r,
                        kind: crate::transport::FailKind::Io(format!(
                            "rank {} contributes {theirs} elements, but outputs[{r}] on rank {} \
                             has {}",
                            world[r], world[me], lens[r]
                        )),
                    });
                }
            }
            c.all_gather_blocks(&mut all, &at)
        })?;
        for (o, b) in outputs.iter_mut().zip(&at) {
            o.as_mut().copy_from_slice(bytemuck::cast_slice(&all[b.clone()]));
        }
        Ok(())
    }

    /// [`ProcessGroup::all_gather_list`] in the background; `wait()` returns `outputs`.
    pub fn all_gather_list_async<T: Element>(
        &self,
        input: Vec<T>,
        mut outputs: Vec<Vec<T>>,
    ) -> Work<Vec<Vec<T>>> {
        self.spawn_ordered("all_gather_list", move |pg, ticket| {
            pg.all_gather_list_ticket(ticket, &input, &mut outputs)?;
            Ok(outputs)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_sizes_are_checked_against_the_buffer_and_the_group() {
        assert_eq!(split_sizes("input", None, 6, 3).unwrap(), vec![2, 2, 2]);
        assert_eq!(split_sizes("input", Some(&[1, 0, 5]), 6, 3).unwrap(), vec![1, 0, 5]);
        let e = split_sizes("input", None, 7, 3).unwrap_err().to_string();
        assert!(e.contains("cannot split evenly: pass input_split_sizes"), "{e}");
        let e = split_sizes("output", Some(&[1, 2]), 3, 3).unwrap_err().to_string();
        assert!(e.contains("output_split_sizes has 2 entries for a group of 3"), "{e}");
        let e = split_sizes("input", Some(&[1, 2, 2]), 6, 3).unwrap_err().to_string();
        assert!(e.contains("input_split_sizes sum to 5, but the input has 6"), "{e}");
    }
}
