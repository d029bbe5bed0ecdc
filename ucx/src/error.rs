//! Errors of the UCX layer.

use thiserror::Error;

use crate::sys;

/// A UCX failure, typed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum UcxError {
    /// libucp could not be loaded, or lacks a function this build needs.
    #[error(
        "the ucx transport needs UCX's {library} ({reason}); install Debian's libucx0 \
         (apt-get install libucx0), or choose another transport"
    )]
    Missing {
        /// The library file.
        library: &'static str,
        /// What the loader said.
        reason: String,
    },
    /// A UCX call returned an error status.
    #[error("{op}: {text} (UCX status {status})")]
    Status {
        /// The call.
        op: &'static str,
        /// The `ucs_status_t`.
        status: i8,
        /// `ucs_status_string` of it.
        text: String,
    },
    /// The environment asks UCX for a transport that cannot be revoked by
    /// closing an endpoint.
    #[error("UCX_TLS={value:?} allows {transport}, whose writes an endpoint close does not fence; exclude it (kvmesh's default is \"^sm\")")]
    UnsafeTransport {
        /// The variable's value.
        value: String,
        /// The transport named.
        transport: String,
    },
    /// The progress thread is gone (its owner was dropped, or it failed).
    #[error("the UCX progress thread has stopped")]
    Stopped,
    /// No endpoint is bound to this key on this side.
    #[error("no endpoint is bound to key {0:#018x}")]
    NotBound(u64),
    /// The target refused the bind, or closed the endpoint (revoked).
    #[error("the target closed the endpoint of key {0:#018x} (revoked or refused)")]
    Closed(u64),
    /// A put would fall outside the remote region.
    #[error("put of {len} bytes at offset {offset} is outside the {region}-byte region")]
    OutOfRange {
        /// Offset in the region.
        offset: u64,
        /// Bytes.
        len: usize,
        /// The region's size.
        region: u64,
    },
    /// A bad socket address.
    #[error("bad address {0:?}")]
    Address(String),
    /// Something did not answer in time.
    #[error("timed out: {0}")]
    Timeout(&'static str),
    /// The OS refused a resource (eventfd, mapping, thread).
    #[error("{op}: {reason}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The OS error, as text.
        reason: String,
    },
}

impl UcxError {
    /// A short stable name, used as a metric label.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Missing { .. } => "ucx_missing",
            Self::Status { .. } => "ucx_status",
            Self::UnsafeTransport { .. } => "ucx_unsafe_transport",
            Self::Stopped => "ucx_stopped",
            Self::NotBound(_) => "ucx_not_bound",
            Self::Closed(_) => "ucx_closed",
            Self::OutOfRange { .. } => "ucx_out_of_range",
            Self::Address(_) => "ucx_address",
            Self::Timeout(_) => "ucx_timeout",
            Self::Os { .. } => "ucx_os",
        }
    }

    pub(crate) fn os(op: &'static str, e: impl std::fmt::Display) -> Self {
        Self::Os {
            op,
            reason: e.to_string(),
        }
    }

    /// `status` as an error of `op`, or `Ok` for `UCS_OK`.
    pub(crate) fn check(
        api: &crate::Api,
        op: &'static str,
        status: sys::ucs_status_t,
    ) -> Result<(), Self> {
        if status == sys::UCS_OK {
            Ok(())
        } else {
            Err(Self::status(api, op, status))
        }
    }

    pub(crate) fn status(api: &crate::Api, op: &'static str, status: sys::ucs_status_t) -> Self {
        Self::Status {
            op,
            status,
            text: api.status_text(status),
        }
    }
}
