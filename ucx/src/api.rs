//! Loading libucp at run time, once per process.

use std::ffi::CStr;
use std::fmt;
use std::sync::OnceLock;

use crate::error::UcxError;
use crate::sys;

/// The library file opened: Debian's `libucx0` installs it.
pub const LIBRARY: &str = "libucp.so.0";

/// The loaded UCP library; every function [`sys::Ucp`] names is present.
pub struct Api {
    ucp: sys::Ucp,
}

impl fmt::Debug for Api {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (a, b, c) = self.version();
        write!(f, "Api(libucp {a}.{b}.{c})")
    }
}

static API: OnceLock<Result<Api, UcxError>> = OnceLock::new();

/// Opens libucp (once per process) and checks that it has every function
/// this build calls. The error names the package to install.
pub fn load() -> Result<&'static Api, UcxError> {
    API.get_or_init(open).as_ref().map_err(Clone::clone)
}

/// The loaded library's version (`ucp_get_version`), if it loads.
pub fn version() -> Result<(u32, u32, u32), UcxError> {
    load().map(Api::version)
}

fn open() -> Result<Api, UcxError> {
    let missing = |reason: String| UcxError::Missing {
        library: LIBRARY,
        reason,
    };
    // SAFETY: loading libucp runs its constructors (UCS's global init),
    // which are meant to run in any process that links it.
    let ucp = unsafe { sys::Ucp::new(LIBRARY) }.map_err(|e| missing(e.to_string()))?;
    macro_rules! require {
        ($($f:ident),* $(,)?) => {
            $(if let Err(e) = &ucp.$f {
                return Err(missing(format!("{}: {e}", stringify!($f))));
            })*
        };
    }
    require!(
        ucs_status_string,
        ucp_config_read,
        ucp_config_release,
        ucp_config_modify,
        ucp_get_version,
        ucp_init_version,
        ucp_cleanup,
        ucp_worker_create,
        ucp_worker_destroy,
        ucp_worker_progress,
        ucp_worker_get_efd,
        ucp_worker_arm,
        ucp_worker_set_am_recv_handler,
        ucp_listener_create,
        ucp_listener_destroy,
        ucp_listener_query,
        ucp_listener_reject,
        ucp_conn_request_query,
        ucp_ep_create,
        ucp_ep_close_nbx,
        ucp_ep_flush_nbx,
        ucp_ep_rkey_unpack,
        ucp_rkey_destroy,
        ucp_rkey_pack,
        ucp_rkey_buffer_release,
        ucp_mem_map,
        ucp_mem_unmap,
        ucp_put_nbx,
        ucp_am_send_nbx,
        ucp_request_check_status,
        ucp_request_free,
    );
    let api = Api { ucp };
    let (major, minor, _) = api.version();
    // The structures in sys.rs are 1.13's; UCP keeps them
    // backward-compatible (field masks), so newer 1.x libraries work.
    if major != sys::UCP_API_MAJOR || minor < sys::UCP_API_MINOR {
        return Err(missing(format!(
            "version {major}.{minor} found, {}.{} or a later 1.x needed",
            sys::UCP_API_MAJOR,
            sys::UCP_API_MINOR
        )));
    }
    Ok(api)
}

impl Api {
    /// The raw functions. Every one is present (checked by [`load`]), so
    /// their wrappers never panic.
    pub(crate) fn ucp(&self) -> &sys::Ucp {
        &self.ucp
    }

    /// `ucp_get_version`.
    pub fn version(&self) -> (u32, u32, u32) {
        let (mut a, mut b, mut c) = (0, 0, 0);
        // SAFETY: three valid out-pointers.
        unsafe { self.ucp.ucp_get_version(&mut a, &mut b, &mut c) };
        (a, b, c)
    }

    /// `ucs_status_string`.
    pub fn status_text(&self, status: sys::ucs_status_t) -> String {
        // SAFETY: returns a pointer to a static string for any status.
        let p = unsafe { self.ucp.ucs_status_string(status) };
        if p.is_null() {
            return format!("status {status}");
        }
        // SAFETY: non-null, NUL-terminated, static.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}
