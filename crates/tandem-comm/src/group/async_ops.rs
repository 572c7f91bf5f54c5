//! The `async_op=True` forms of the collectives defined in `group.rs`: each takes its buffers
//! by value, runs after every call this rank issued before it, and `wait()` gives them back.
use super::ProcessGroup;
use crate::collectives::ScatterInput;
use crate::element::{Element, ReduceOp};
use crate::work::Work;

impl ProcessGroup {
    /// [`ProcessGroup::all_gather`] in the background; `wait()` returns `output`.
    pub fn all_gather_async<T: Element>(&self, input: Vec<T>, mut output: Vec<T>) -> Work<Vec<T>> {
        self.spawn_ordered("all_gather", move |pg, ticket| {
            pg.all_gather_ticket(ticket, &input, &mut output)?;
            Ok(output)
        })
    }

    /// [`ProcessGroup::reduce_scatter`] in the background; `wait()` returns `output`. The ring
    /// reduces into `input` itself (it is handed over): no copy of it is made.
    pub fn reduce_scatter_async<T: Element>(
        &self,
        mut input: Vec<T>,
        mut output: Vec<T>,
        op: ReduceOp,
    ) -> Work<Vec<T>> {
        self.spawn_ordered("reduce_scatter", move |pg, ticket| {
            let scratch = ScatterInput::Scratch(bytemuck::cast_slice_mut(&mut input));
            pg.reduce_scatter_ticket(ticket, scratch, &mut output, op)?;
            Ok(output)
        })
    }

    /// [`ProcessGroup::gather`] in the background; `wait()` returns root's `output` (`None`
    /// elsewhere).
    pub fn gather_async<T: Element>(
        &self,
        input: Vec<T>,
        mut output: Option<Vec<T>>,
        root: usize,
    ) -> Work<Option<Vec<T>>> {
        self.spawn_ordered("gather", move |pg, ticket| {
            pg.gather_ticket(ticket, &input, output.as_deref_mut(), root)?;
            Ok(output)
        })
    }

    /// [`ProcessGroup::scatter`] in the background; `wait()` returns `output`.
    pub fn scatter_async<T: Element>(
        &self,
        input: Option<Vec<T>>,
        mut output: Vec<T>,
        root: usize,
    ) -> Work<Vec<T>> {
        self.spawn_ordered("scatter", move |pg, ticket| {
            pg.scatter_ticket(ticket, input.as_deref(), &mut output, root)?;
            Ok(output)
        })
    }

    /// [`ProcessGroup::barrier`] in the background.
    pub fn barrier_async(&self) -> Work<()> {
        self.spawn_ordered("barrier", |pg, ticket| pg.barrier_ticket(ticket))
    }
}
