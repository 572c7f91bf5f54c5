//! Rooted and pre-scaled reductions: PyTorch's `reduce` and `ReduceOp.PREMUL_SUM`.
use super::{check_op, check_root, divide, op_code, Call, ProcessGroup};
use crate::collectives::{ReduceFn, Reduction};
use crate::element::{reduce_bytes, Element, ReduceOp};
use crate::error::CommError;
use crate::order::Ticket;
use crate::work::Work;

impl ProcessGroup {
    /// Reduces every rank's `buf` into rank `dst`'s `buf` (PyTorch's `reduce`). The other
    /// ranks' buffers are left as they were (gloo leaves partial results there).
    pub fn reduce<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        dst: usize,
    ) -> Result<(), CommError> {
        self.reduce_ticket(self.ticket(), buf, op, dst)
    }

    fn reduce_ticket<T: Element>(
        &self,
        ticket: Ticket,
        buf: &mut [T],
        op: ReduceOp,
        dst: usize,
    ) -> Result<(), CommError> {
        check_root("reduce", dst, self.size())?;
        check_op::<T>("reduce", op)?;
        let call = Call::new("reduce", Some(T::DTYPE), buf.len(), op_code(op) | (dst as u64) << 8);
        let f = move |d: &mut [u8], s: &[u8]| reduce_bytes::<T>(op, d, s);
        let f: ReduceFn<'_> = &f;
        let r = Reduction { dtype: T::DTYPE, op, f };
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(buf);
        self.collective(ticket, call, |c| c.reduce(bytes, dst, r))?;
        if op == ReduceOp::Avg && self.rank() == dst {
            divide(buf, self.size());
        }
        Ok(())
    }

    /// [`ProcessGroup::reduce`] in the background; `wait()` returns the buffer.
    pub fn reduce_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        dst: usize,
    ) -> Work<Vec<T>> {
        self.spawn_ordered("reduce", move |pg, ticket| {
            pg.reduce_ticket(ticket, &mut buf, op, dst)?;
            Ok(buf)
        })
    }

    /// Sums `factor × buf` over ranks into every rank's `buf` (PyTorch's
    /// `_make_nccl_premul_sum(factor)`, which gloo lacks): each rank scales its own buffer
    /// first, the factor rounded to the element type as NCCL does. Floating-point elements.
    pub fn all_reduce_premul_sum<T: Element>(
        &self,
        buf: &mut [T],
        factor: f64,
    ) -> Result<(), CommError> {
        check_premul::<T>(factor)?;
        buf.iter_mut().for_each(|x| *x = T::premul(*x, factor));
        self.all_reduce(buf, ReduceOp::Sum)
    }

    /// [`ProcessGroup::all_reduce_premul_sum`] in the background.
    pub fn all_reduce_premul_sum_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        factor: f64,
    ) -> Work<Vec<T>> {
        if let Err(e) = check_premul::<T>(factor) {
            return Work::failed("all_reduce", e);
        }
        buf.iter_mut().for_each(|x| *x = T::premul(*x, factor));
        self.all_reduce_async(buf, ReduceOp::Sum)
    }
}

fn check_premul<T: Element>(factor: f64) -> Result<(), CommError> {
    if T::INTEGER {
        return Err(CommError::invalid(
            "all_reduce",
            format!("premul_sum of {} elements: it takes floating-point elements", T::DTYPE),
        ));
    }
    if !factor.is_finite() {
        return Err(CommError::invalid(
            "all_reduce",
            format!("premul_sum factor {factor} is not finite"),
        ));
    }
    Ok(())
}
