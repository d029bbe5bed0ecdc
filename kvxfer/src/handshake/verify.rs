//! Verification before live (I4).

use kvmesh_kvpool::Reservation;
use kvmesh_kvwire::{Grant, TransferDone};

use super::error::VerifyError;

/// I4: exactly the granted prompt, every page still held at its granted
/// generation, every page's landed checksum equal to the writer's.
pub(super) fn verify(
    grant: &Grant,
    res: &Reservation,
    done: &TransferDone,
) -> Result<(), VerifyError> {
    if done.tokens_written != grant.prompt_tokens {
        return Err(VerifyError::TokenCount {
            granted: grant.prompt_tokens,
            written: done.tokens_written,
        });
    }
    if done.page_checksums.len() != grant.pages.len() {
        return Err(VerifyError::PageCount {
            granted: grant.pages.len(),
            written: done.page_checksums.len(),
        });
    }
    res.check_held(&grant.pages)
        .map_err(|n| VerifyError::PageNotHeld {
            index: n.index,
            page: n.granted.page,
            granted: n.granted.generation,
            now: n.generation,
        })?;
    for (index, &reported) in done.page_checksums.iter().enumerate() {
        let slots = grant.prompt_slots(index).unwrap_or(0) as usize;
        let landed = crate::landing::landed_checksum(res, index, slots).unwrap_or(!reported);
        if landed != reported {
            return Err(VerifyError::Checksum {
                index,
                landed,
                reported,
            });
        }
    }
    Ok(())
}
