//! The desync check (`TORCH_DISTRIBUTED_DEBUG=DETAIL`): before each collective every rank
//! shares what it is calling (sequence, op, dtype, count, root or operator), and a difference
//! fails the call on every rank with both ranks' calls named.

use crate::collectives::Ctx;
use crate::element::{ReduceOp, WireType};
use crate::transport::{FailKind, PeerError};

/// What a rank is calling, as compared across ranks by the desync check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Call {
    pub(super) op: &'static str,
    dtype: Option<WireType>,
    count: u64,
    /// Root, peer, or reduce operator code, depending on the op.
    arg: u64,
}

const OPS: [&str; 17] = [
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "gather",
    "scatter",
    "barrier",
    "broadcast_bytes",
    "all_gather_bytes",
    "send",
    "recv",
    "reduce",
    "all_to_all",
    "all_gather_list",
    "gather_bytes",
    "scatter_bytes",
    "unknown",
];

impl Call {
    pub(super) fn new(op: &'static str, dtype: Option<WireType>, count: usize, arg: u64) -> Call {
        Call { op, dtype, count: count as u64, arg }
    }
    pub(super) fn encode(&self, seq: u64) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..8].copy_from_slice(&seq.to_le_bytes());
        b[8] = OPS.iter().position(|o| *o == self.op).unwrap_or(OPS.len() - 1) as u8;
        b[9] = self.dtype.map_or(255, |d| d.code());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.arg.to_le_bytes());
        b
    }
    pub(super) fn describe(b: &[u8]) -> String {
        let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap_or([0; 8]));
        let op = OPS.get(b[8] as usize).copied().unwrap_or("unknown");
        let dtype = WireType::from_code(b[9]).map_or("bytes", |d| d.name());
        let arg = u(24..32);
        let arg = match op {
            "all_reduce" | "reduce_scatter" => format!(", {}", op_name(arg)),
            "reduce" => format!(", {}, root {}", op_name(arg & 0xff), arg >> 8),
            "broadcast" | "gather" | "scatter" | "broadcast_bytes" | "gather_bytes"
            | "scatter_bytes" => format!(", root {arg}"),
            "send" => format!(", to {arg}"),
            "recv" => format!(", from {arg}"),
            _ => String::new(),
        };
        format!("{op}(#{}, {dtype}, {} elements{arg})", u(0..8), u(16..24))
    }
}

fn op_name(code: u64) -> &'static str {
    ReduceOp::ALL.get(code as usize).map_or("?", |o| o.name())
}

pub(super) fn op_code(op: ReduceOp) -> u64 {
    match op {
        ReduceOp::Sum => 0,
        ReduceOp::Avg => 1,
        ReduceOp::Max => 2,
        ReduceOp::Min => 3,
        ReduceOp::Product => 4,
        ReduceOp::BitAnd => 5,
        ReduceOp::BitOr => 6,
        ReduceOp::BitXor => 7,
    }
}

/// All ranks exchange (sequence, op, dtype, count, arg); any difference names both ranks.
pub(super) fn desync_check(ctx: &mut Ctx<'_>, mine: &[u8; 32]) -> Result<(), PeerError> {
    let n = ctx.size;
    let mut all = vec![0u8; 32 * n];
    all[32 * ctx.rank..32 * ctx.rank + 32].copy_from_slice(mine);
    let bounds: Vec<_> = (0..n).map(|r| 32 * r..32 * r + 32).collect();
    ctx.all_gather_blocks(&mut all, &bounds)?;
    let first = &all[0..32];
    if let Some(b) = (1..n).find(|&r| &all[32 * r..32 * r + 32] != first) {
        return Err(PeerError {
            peer: b,
            kind: FailKind::Desync {
                rank_a: 0,
                call_a: Call::describe(first),
                rank_b: b,
                call_b: Call::describe(&all[32 * b..32 * b + 32]),
            },
        });
    }
    Ok(())
}
