//! Byte and object collectives with a root: `gather_bytes` / `scatter_bytes` (any length per
//! rank), and PyTorch's `*_object` collectives on any serde type. PyTorch pickles objects;
//! tandem encodes them as JSON (serde_json): readable, bounded by the announced lengths like
//! every other byte collective, and never executed.
use super::{alloc_announced, check_root, Call, ProcessGroup};
use crate::error::CommError;
use crate::transport::PeerError;
use serde::de::DeserializeOwned;
use serde::Serialize;

fn encode<T: Serialize>(op: &'static str, rank: usize, obj: &T) -> Result<Vec<u8>, CommError> {
    serde_json::to_vec(obj).map_err(|e| CommError::Object {
        op,
        rank,
        reason: format!("does not encode: {e}"),
    })
}

fn decode<T: DeserializeOwned>(
    op: &'static str,
    rank: usize,
    bytes: &[u8],
) -> Result<T, CommError> {
    serde_json::from_slice(bytes).map_err(|e| CommError::Object {
        op,
        rank,
        reason: format!("does not decode as {}: {e}", std::any::type_name::<T>()),
    })
}

fn le_u64(b: &[u8]) -> u64 {
    u64::from_le_bytes(b.try_into().unwrap_or([0; 8]))
}

impl ProcessGroup {
    /// Root gets every rank's bytes (any length per rank), indexed by rank; other ranks `None`.
    pub fn gather_bytes(
        &self,
        data: &[u8],
        root: usize,
    ) -> Result<Option<Vec<Vec<u8>>>, CommError> {
        check_root("gather_bytes", root, self.size())?;
        let (n, me) = (self.size(), self.rank());
        let call = Call::new("gather_bytes", None, 0, root as u64);
        self.collective(self.ticket(), call, |c| {
            let mut lens = vec![0u8; 8 * n];
            c.gather(
                &(data.len() as u64).to_le_bytes(),
                (me == root).then_some(&mut lens[..]),
                root,
            )?;
            if me != root {
                c.gather_ranges(data, None, root)?;
                return Ok(None);
            }
            let lens: Vec<u64> = lens.chunks_exact(8).map(le_u64).collect();
            // A sum of hostile lengths saturates instead of wrapping, and is then refused.
            let total = lens.iter().fold(0u64, |a, &l| a.saturating_add(l));
            let biggest = (0..n).max_by_key(|&r| lens[r]).unwrap_or(0);
            let mut all = Vec::new();
            alloc_announced(&mut all, total, biggest, u64::MAX)?;
            let lens: Vec<usize> = lens.iter().map(|&l| l as usize).collect();
            let at = crate::collectives::ranges(&lens, 1);
            all.resize(total as usize, 0);
            c.gather_ranges(data, Some((&mut all, &at)), root)?;
            Ok(Some(at.into_iter().map(|b| all[b].to_vec()).collect()))
        })
    }

    /// Rank r gets root's `input[r]` (any length); other ranks pass `None`.
    pub fn scatter_bytes(
        &self,
        input: Option<&[Vec<u8>]>,
        root: usize,
    ) -> Result<Vec<u8>, CommError> {
        check_root("scatter_bytes", root, self.size())?;
        let (n, me) = (self.size(), self.rank());
        if me == root {
            match input {
                Some(i) if i.len() == n => {}
                Some(i) => {
                    return Err(CommError::invalid(
                        "scatter_bytes",
                        format!("root input has {} blocks for a group of {n} ranks", i.len()),
                    ))
                }
                None => {
                    return Err(CommError::invalid(
                        "scatter_bytes",
                        "the root must pass its blocks",
                    ))
                }
            }
        }
        let call = Call::new("scatter_bytes", None, 0, root as u64);
        self.collective(self.ticket(), call, |c| {
            let lens: Option<Vec<u8>> = input
                .filter(|_| me == root)
                .map(|blocks| blocks.iter().flat_map(|b| (b.len() as u64).to_le_bytes()).collect());
            let mut mine = [0u8; 8];
            c.scatter(lens.as_deref(), &mut mine, root)?;
            let len = le_u64(&mine);
            let mut out = Vec::new();
            alloc_announced(&mut out, len, root, u64::MAX)?;
            out.resize(len as usize, 0);
            let flat: Option<(Vec<u8>, Vec<std::ops::Range<usize>>)> =
                input.filter(|_| me == root).map(|blocks| {
                    let at = crate::collectives::ranges(
                        &blocks.iter().map(Vec::len).collect::<Vec<_>>(),
                        1,
                    );
                    (blocks.concat(), at)
                });
            c.scatter_ranges(flat.as_ref().map(|(b, at)| (&b[..], &at[..])), &mut out, root)?;
            Ok::<_, PeerError>(out)
        })
    }

    /// Every rank's `obj`, indexed by rank (PyTorch's `all_gather_object`).
    pub fn all_gather_object<T: Serialize + DeserializeOwned>(
        &self,
        obj: &T,
    ) -> Result<Vec<T>, CommError> {
        let op = "all_gather_object";
        let bytes = encode(op, self.rank(), obj)?;
        let all = self.all_gather_bytes(&bytes)?;
        all.iter().enumerate().map(|(r, b)| decode(op, self.world_ranks()[r], b)).collect()
    }

    /// Root's `objects` replace every other rank's (PyTorch's `broadcast_object_list`, where
    /// the list's length is also root's).
    pub fn broadcast_object_list<T: Serialize + DeserializeOwned>(
        &self,
        objects: &mut Vec<T>,
        root: usize,
    ) -> Result<(), CommError> {
        let op = "broadcast_object_list";
        check_root(op, root, self.size())?;
        let mut bytes = if self.rank() == root { encode(op, root, objects)? } else { Vec::new() };
        self.broadcast_bytes(&mut bytes, root)?;
        if self.rank() != root {
            *objects = decode(op, self.world_ranks()[root], &bytes)?;
        }
        Ok(())
    }

    /// Root gets every rank's `obj`, indexed by rank; other ranks `None` (PyTorch's
    /// `gather_object`).
    pub fn gather_object<T: Serialize + DeserializeOwned>(
        &self,
        obj: &T,
        root: usize,
    ) -> Result<Option<Vec<T>>, CommError> {
        let op = "gather_object";
        let bytes = encode(op, self.rank(), obj)?;
        let Some(all) = self.gather_bytes(&bytes, root)? else { return Ok(None) };
        let objs = all.iter().enumerate().map(|(r, b)| decode(op, self.world_ranks()[r], b));
        objs.collect::<Result<Vec<T>, _>>().map(Some)
    }

    /// Rank r gets root's `objects[r]` (PyTorch's `scatter_object_list`); other ranks pass
    /// `None`.
    pub fn scatter_object_list<T: Serialize + DeserializeOwned>(
        &self,
        objects: Option<&[T]>,
        root: usize,
    ) -> Result<T, CommError> {
        let op = "scatter_object_list";
        let blocks = match objects.filter(|_| self.rank() == root) {
            Some(objs) => {
                Some(objs.iter().map(|o| encode(op, root, o)).collect::<Result<Vec<_>, _>>()?)
            }
            None => None,
        };
        let mine = self.scatter_bytes(blocks.as_deref(), root)?;
        decode(op, self.world_ranks()[root], &mine)
    }
}
