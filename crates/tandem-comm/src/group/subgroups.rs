//! PyTorch's `new_subgroups` and `new_subgroups_by_enumeration`: a partition of a group into
//! subgroups, each built with `new_group` from the group's one store.
use super::ProcessGroup;
use crate::error::CommError;

impl ProcessGroup {
    /// Splits the group into consecutive subgroups of `group_size` ranks (ranks 0..k, k..2k,
    /// ...) and returns this rank's (PyTorch's `new_subgroups`). Without a size, one subgroup
    /// per host's worth of ranks (this group's local size, as PyTorch uses the devices per
    /// host). A collective call: every rank of the group makes it.
    pub fn new_subgroups(&self, group_size: Option<usize>) -> Result<ProcessGroup, CommError> {
        let n = self.size();
        let k = group_size.unwrap_or(self.local_size());
        if k == 0 || !n.is_multiple_of(k) {
            return Err(CommError::invalid(
                "new_subgroups",
                format!("group_size {k} does not divide the group's {n} ranks"),
            ));
        }
        let lists: Vec<Vec<usize>> = (0..n / k).map(|g| (g * k..(g + 1) * k).collect()).collect();
        let mine = self.new_subgroups_by_enumeration(&lists)?;
        mine.ok_or_else(|| CommError::Internal {
            op: "new_subgroups",
            reason: format!("rank {} is in none of {lists:?}", self.rank()),
        })
    }

    /// One subgroup per list of ranks (which must not overlap), returning the one this rank is
    /// in, or `None` (PyTorch's `new_subgroups_by_enumeration`). A collective call: every rank
    /// of the group makes it with the same lists.
    pub fn new_subgroups_by_enumeration(
        &self,
        ranks_per_subgroup: &[Vec<usize>],
    ) -> Result<Option<ProcessGroup>, CommError> {
        let mut seen = vec![None; self.size()];
        for (g, ranks) in ranks_per_subgroup.iter().enumerate() {
            for &r in ranks {
                match seen.get_mut(r) {
                    None => {
                        return Err(CommError::invalid(
                            "new_subgroups_by_enumeration",
                            format!(
                                "subgroup {g} names rank {r}, outside this {}-rank group",
                                self.size()
                            ),
                        ))
                    }
                    Some(Some(first)) => {
                        return Err(CommError::invalid(
                            "new_subgroups_by_enumeration",
                            format!(
                            "rank {r} is in subgroups {first} and {g}: subgroups must not overlap"
                        ),
                        ))
                    }
                    Some(slot) => *slot = Some(g),
                }
            }
        }
        let mut mine = None;
        for ranks in ranks_per_subgroup {
            if let Some(g) = self.new_group(ranks)? {
                mine = Some(g);
            }
        }
        Ok(mine)
    }
}
