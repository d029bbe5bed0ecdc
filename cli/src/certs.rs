//! `kvmesh certs`: a mesh's certificate authority and each process's
//! certificate, as `mesh.tls` and `etcd.tls` read them (issue 35 item 1).
//!
//! Layout of the folder it writes (`--out`):
//! - `ca.pem`: the CA certificate every process trusts (the mesh file's
//!   `ca_file`); `ca-key.pem`: its key (0600; or where `--ca-key` says),
//!   needed only to sign more names: keep it off the nodes.
//! - `NAME.pem`, `NAME-key.pem` (0600) for each `--name`: a certificate
//!   whose subject alternative names are NAME and the extra names given
//!   with it, usable as server and as client (both TLS usages), since every
//!   process of the mesh is both; `{name}` in the mesh file picks them.
//!
//! Invariants: nothing is replaced unless `--force` says so, and an
//! existing CA is used only when `--reuse-ca` says so (how a joining node
//! gets its certificate from the same CA); every refusal is found before
//! the first file is written. Each certificate is checked against the CA
//! with rustls's own verifiers (as a server for each of its names, and as a
//! client) before it is written, so a CA key that does not belong to
//! `ca.pem` is refused instead of minting certificates no peer accepts.
//! Keys are ECDSA P-256, fresh per certificate.

use std::fmt;
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::client::danger::ServerCertVerifier;
use rustls::client::WebPkiServerVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;
use thiserror::Error;

/// The CA certificate's file name in `--out`.
pub const CA_FILE: &str = "ca.pem";
/// The CA key's file name in `--out`.
pub const CA_KEY_FILE: &str = "ca-key.pem";

/// `kvmesh certs`'s arguments.
#[derive(clap::Args, Debug)]
#[command(after_long_help = EXAMPLES)]
pub struct CertsArgs {
    /// The folder to write into (made, mode 0700, if missing).
    #[arg(long, env = "KVMESH_CERTS_OUT")]
    pub out: PathBuf,
    /// A process's certificate, as NAME or NAME:ALSO,ALSO,... (repeatable). NAME is the node's name in the mesh file (`router` for the router) and is always one of the certificate's names; ALSO are the other DNS names and IP addresses its peers dial it by (an etcd's: the host in the mesh file's etcd.endpoints).
    #[arg(long = "name", value_name = "NAME[:ALSO,...]")]
    pub names: Vec<NameSpec>,
    /// The CA's key: written there (0600) with a new CA, read from there with --reuse-ca [default: OUT/ca-key.pem]. Outside --out, the folder holds only what the processes need (a Kubernetes Secret made from it, say).
    #[arg(long, env = "KVMESH_CERTS_CA_KEY")]
    pub ca_key: Option<PathBuf>,
    /// Sign with the CA already there (OUT/ca.pem and the CA key) instead of making one: how a node joining a running mesh gets its certificate.
    #[arg(long)]
    pub reuse_ca: bool,
    /// Replace files that exist: the CA (without --reuse-ca; certificates the old one signed are then trusted no more) and the named certificates and keys.
    #[arg(long)]
    pub force: bool,
    /// Days each named certificate is valid from now (renew with --reuse-ca --force --name NAME; the mesh reloads changed files).
    #[arg(long, env = "KVMESH_CERTS_DAYS", default_value_t = 365,
          value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub days: u32,
    /// Days a new CA is valid from now.
    #[arg(long, default_value_t = 3650, value_parser = clap::value_parser!(u32).range(1..=36500))]
    pub ca_days: u32,
}

const EXAMPLES: &str = "\
Examples:
  # A new mesh: its CA, and the certificates of docker-compose.etcd.yml's
  # processes (etcd's names are the host the nodes dial, etcd).
  kvmesh certs --out deploy/certs --name router --name prefill-0 \\
      --name decode-0 --name decode-1 --name etcd:localhost,127.0.0.1

  # A node joining later, signed by the same CA.
  kvmesh certs --out deploy/certs --reuse-ca --name decode-2

  # The CA key outside the folder, which then holds only what the
  # processes need (a Kubernetes Secret made from it).
  kvmesh certs --out certs --ca-key ca-key.pem --name router \\
      --name kvmesh-decode-0:kvmesh-decode-0.kvmesh-decode

Files: ca.pem (trusted by every process), ca-key.pem (0600; only for
signing more names: keep it off the nodes), and NAME.pem and NAME-key.pem
(0600) per name. Each process needs ca.pem and its own two files, readable
by the user it runs as (chown the key to that user) and by no one else.";

/// One `--name`: a process's name and the other names its certificate
/// carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameSpec {
    /// The process's node name: the files' stem and the first
    /// subject alternative name.
    pub name: String,
    /// More DNS names or IP addresses, in the order given, without
    /// repeats.
    pub also: Vec<String>,
}

impl NameSpec {
    /// Every subject alternative name: the name, then the others.
    pub fn alt_names(&self) -> Vec<String> {
        std::iter::once(self.name.clone())
            .chain(self.also.iter().cloned())
            .collect()
    }
}

impl fmt::Display for NameSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)?;
        if !self.also.is_empty() {
            write!(f, ":{}", self.also.join(","))?;
        }
        Ok(())
    }
}

impl FromStr for NameSpec {
    type Err = CertsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, rest) = match s.split_once(':') {
            Some((n, r)) => (n, Some(r)),
            None => (s, None),
        };
        let bad = |reason: &str| CertsError::BadName {
            name: s.to_owned(),
            reason: reason.to_owned(),
        };
        if name.is_empty() || name.len() > 63 {
            return Err(bad("a node name of 1 to 63 characters comes first"));
        }
        if !name.starts_with(|c: char| c.is_ascii_alphanumeric())
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.')
        {
            return Err(bad(
                "a node name is letters, digits, '-' and '.', starting with a letter or digit",
            ));
        }
        if name == "ca" || name.ends_with("-key") {
            return Err(bad(
                "names the CA's or a key's file: choose another node name",
            ));
        }
        if ServerName::try_from(name).is_err() {
            return Err(bad("not a DNS name or IP address"));
        }
        let mut also: Vec<String> = Vec::new();
        for a in rest.map(|r| r.split(',')).into_iter().flatten() {
            if a.is_empty() {
                return Err(bad("an empty name after ':' or ','"));
            }
            if ServerName::try_from(a).is_err() {
                return Err(CertsError::BadName {
                    name: s.to_owned(),
                    reason: format!("{a:?} is not a DNS name or IP address"),
                });
            }
            if a != name && !also.iter().any(|x| x == a) {
                also.push(a.to_owned());
            }
        }
        Ok(Self {
            name: name.to_owned(),
            also,
        })
    }
}

/// Why `kvmesh certs` wrote nothing (or, for [`CertsError::Io`] and
/// [`CertsError::Mint`] after the checks, stopped).
#[derive(Debug, Error)]
pub enum CertsError {
    /// A `--name` that cannot be used.
    #[error("--name {name:?}: {reason}")]
    BadName {
        /// The argument.
        name: String,
        /// Why.
        reason: String,
    },
    /// The same name twice.
    #[error("--name {0:?} is given twice")]
    Duplicate(String),
    /// `--reuse-ca` with nothing to sign.
    #[error("--reuse-ca signs the --name certificates: name at least one")]
    NothingToDo,
    /// A CA file exists and neither `--reuse-ca` nor `--force` was given.
    #[error(
        "{}: a CA is there already: pass --reuse-ca to sign more names with it, or --force \
         to replace it (every certificate the old CA signed would stop being trusted)",
        .0.display()
    )]
    CaExists(PathBuf),
    /// `--reuse-ca`, but the CA's certificate or key is missing.
    #[error("--reuse-ca: {}: {source}", .path.display())]
    NoCaToReuse {
        /// The missing (or unreadable) file.
        path: PathBuf,
        /// Why it cannot be read.
        source: std::io::Error,
    },
    /// The CA in the folder cannot sign (not PEM, not a certificate, a key
    /// that does not belong to it).
    #[error("--reuse-ca: {}: {reason}", .path.display())]
    CaUnusable {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A named certificate or key exists and `--force` was not given.
    #[error("{}: exists: pass --force to replace it", .0.display())]
    Exists(PathBuf),
    /// rcgen refused to make a key or certificate.
    #[error("minting {what}: {source}")]
    Mint {
        /// What was being made.
        what: String,
        /// rcgen's error.
        source: rcgen::Error,
    },
    /// A minted certificate does not verify against the CA.
    #[error("{name}: the new certificate does not verify against {}: {reason}", .ca.display())]
    Verify {
        /// The certificate's name.
        name: String,
        /// The CA file.
        ca: PathBuf,
        /// rustls's reason.
        reason: String,
    },
    /// The file system refused.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// What to mint.
#[derive(Clone, Debug)]
pub struct Request {
    /// The folder.
    pub out: PathBuf,
    /// The names.
    pub names: Vec<NameSpec>,
    /// The CA key's file; `None`: `out/ca-key.pem`.
    pub ca_key: Option<PathBuf>,
    /// Sign with the CA in `out`.
    pub reuse_ca: bool,
    /// Replace what exists.
    pub force: bool,
    /// Validity of each named certificate, days.
    pub days: u32,
    /// Validity of a new CA, days.
    pub ca_days: u32,
}

impl From<CertsArgs> for Request {
    fn from(a: CertsArgs) -> Self {
        Self {
            out: a.out,
            names: a.names,
            ca_key: a.ca_key,
            reuse_ca: a.reuse_ca,
            force: a.force,
            days: a.days,
            ca_days: a.ca_days,
        }
    }
}

/// What was written.
#[derive(Debug)]
pub struct Minted {
    /// The CA certificate.
    pub ca: PathBuf,
    /// The CA's key.
    pub ca_key: PathBuf,
    /// Whether the CA was made by this call (else reused).
    pub new_ca: bool,
    /// Each name with its certificate and key files.
    pub written: Vec<(NameSpec, PathBuf, PathBuf)>,
}

/// `kvmesh certs`.
pub fn run(a: CertsArgs) -> anyhow::Result<()> {
    let m = mint(&a.into())?;
    if m.new_ca {
        println!(
            "new CA: {} (its key {}: keep it off the nodes)",
            m.ca.display(),
            m.ca_key.display()
        );
    } else {
        println!("signed with the CA {}", m.ca.display());
    }
    for (spec, cert, key) in &m.written {
        println!(
            "{}: {} and {} (names: {})",
            spec.name,
            cert.display(),
            key.display(),
            spec.alt_names().join(", ")
        );
    }
    Ok(())
}

/// Mints what `r` asks for into `r.out`; see the module's invariants.
pub fn mint(r: &Request) -> Result<Minted, CertsError> {
    let ca_file = r.out.join(CA_FILE);
    let ca_key_file = r.ca_key.clone().unwrap_or_else(|| r.out.join(CA_KEY_FILE));
    let mut seen: Vec<&str> = Vec::new();
    for spec in &r.names {
        if seen.contains(&spec.name.as_str()) {
            return Err(CertsError::Duplicate(spec.name.clone()));
        }
        seen.push(&spec.name);
    }
    if r.reuse_ca && r.names.is_empty() {
        return Err(CertsError::NothingToDo);
    }
    // Every refusal before the first write.
    if !r.reuse_ca && !r.force {
        if let Some(p) = [&ca_file, &ca_key_file].into_iter().find(|p| exists(p)) {
            return Err(CertsError::CaExists(p.clone()));
        }
    }
    let files: Vec<(PathBuf, PathBuf)> = r
        .names
        .iter()
        .map(|s| {
            (
                r.out.join(format!("{}.pem", s.name)),
                r.out.join(format!("{}-key.pem", s.name)),
            )
        })
        .collect();
    if !r.force {
        if let Some(p) = files.iter().flat_map(|(c, k)| [c, k]).find(|p| exists(p)) {
            return Err(CertsError::Exists(p.clone()));
        }
    }
    let now = time::OffsetDateTime::now_utc();
    let ca = if r.reuse_ca {
        Ca::read(&ca_file, &ca_key_file)?
    } else {
        Ca::new(now, r.ca_days)?
    };
    let verifiers = Verifiers::new(&ca.der, &ca_file)?;
    let mut minted = Vec::new();
    for spec in &r.names {
        let (cert, key) = ca.sign(spec, now, r.days)?;
        verifiers.check(spec, &cert)?;
        minted.push((cert, key));
    }

    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&r.out)
        .map_err(|source| io(&r.out, source))?;
    if !r.reuse_ca {
        write(&ca_key_file, &ca.key_pem, 0o600, r.force)?;
        write(&ca_file, &ca.pem, 0o644, r.force)?;
    }
    let mut written = Vec::new();
    for ((spec, (cert_file, key_file)), (cert, key)) in r.names.iter().zip(files).zip(minted) {
        write(&key_file, &key, 0o600, r.force)?;
        write(&cert_file, &cert.pem, 0o644, r.force)?;
        written.push((spec.clone(), cert_file, key_file));
    }
    Ok(Minted {
        ca: ca_file,
        ca_key: ca_key_file,
        new_ca: !r.reuse_ca,
        written,
    })
}

/// A CA that can sign: its certificate (PEM and DER), its key's PEM, and
/// rcgen's issuer.
struct Ca {
    pem: String,
    der: CertificateDer<'static>,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A minted certificate.
struct Cert {
    pem: String,
    der: CertificateDer<'static>,
}

fn mint_err(what: impl Into<String>) -> impl FnOnce(rcgen::Error) -> CertsError {
    let what = what.into();
    move |source| CertsError::Mint { what, source }
}

/// From an hour ago (clocks of a mesh differ a little) to `days` ahead.
fn validity(p: &mut CertificateParams, now: time::OffsetDateTime, days: u32) {
    p.not_before = now - time::Duration::hours(1);
    p.not_after = now + time::Duration::days(i64::from(days));
}

impl Ca {
    /// A new CA. Its name carries a random tag, so two meshes' CAs never
    /// share a subject: a certificate of the other one is then an unknown
    /// issuer to a peer, not a bad signature.
    fn new(now: time::OffsetDateTime, days: u32) -> Result<Self, CertsError> {
        let tag: u64 = rand::random();
        let mut p = CertificateParams::new(Vec::<String>::new()).map_err(mint_err("the CA"))?;
        p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        p.distinguished_name
            .push(DnType::CommonName, format!("kvmesh mesh CA {tag:016x}"));
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        validity(&mut p, now, days);
        let key = KeyPair::generate().map_err(mint_err("the CA's key"))?;
        let cert = p.self_signed(&key).map_err(mint_err("the CA"))?;
        Ok(Self {
            pem: cert.pem(),
            der: cert.der().clone(),
            key_pem: key.serialize_pem(),
            issuer: Issuer::new(p, key),
        })
    }

    /// The CA in the folder.
    fn read(ca_file: &Path, key_file: &Path) -> Result<Self, CertsError> {
        let read = |path: &Path| {
            std::fs::read_to_string(path).map_err(|source| CertsError::NoCaToReuse {
                path: path.to_owned(),
                source,
            })
        };
        let (pem, key_pem) = (read(ca_file)?, read(key_file)?);
        let unusable = |path: &Path, reason: String| CertsError::CaUnusable {
            path: path.to_owned(),
            reason,
        };
        let der = CertificateDer::from_pem_slice(pem.as_bytes())
            .map_err(|e| unusable(ca_file, format!("no PEM certificate: {e}")))?;
        let key = KeyPair::from_pem(&key_pem)
            .map_err(|e| unusable(key_file, format!("not a usable private key: {e}")))?;
        let issuer = Issuer::from_ca_cert_pem(&pem, key)
            .map_err(|e| unusable(ca_file, format!("not a CA certificate rcgen can read: {e}")))?;
        Ok(Self {
            pem,
            der,
            key_pem,
            issuer,
        })
    }

    /// A certificate for `spec`, valid for `days`: its PEM and DER, and its
    /// key's PEM.
    fn sign(
        &self,
        spec: &NameSpec,
        now: time::OffsetDateTime,
        days: u32,
    ) -> Result<(Cert, String), CertsError> {
        let what = || format!("{}'s certificate", spec.name);
        let mut p = CertificateParams::new(spec.alt_names()).map_err(mint_err(what()))?;
        p.distinguished_name
            .push(DnType::CommonName, spec.name.clone());
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.use_authority_key_identifier_extension = true;
        validity(&mut p, now, days);
        let key = KeyPair::generate().map_err(mint_err(what()))?;
        let cert = p.signed_by(&key, &self.issuer).map_err(mint_err(what()))?;
        Ok((
            Cert {
                pem: cert.pem(),
                der: cert.der().clone(),
            },
            key.serialize_pem(),
        ))
    }
}

/// rustls's checks of a peer's certificate against the CA, as a server
/// and as a client.
struct Verifiers {
    ca: PathBuf,
    server: Arc<WebPkiServerVerifier>,
    client: Arc<dyn ClientCertVerifier>,
}

impl Verifiers {
    fn new(ca_der: &CertificateDer<'static>, ca: &Path) -> Result<Self, CertsError> {
        let unusable = |reason: String| CertsError::CaUnusable {
            path: ca.to_owned(),
            reason,
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = RootCertStore::empty();
        roots
            .add(ca_der.clone())
            .map_err(|e| unusable(format!("not a usable CA certificate: {e}")))?;
        let roots = Arc::new(roots);
        let server =
            WebPkiServerVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
                .build()
                .map_err(|e| unusable(e.to_string()))?;
        let client = WebPkiClientVerifier::builder_with_provider(roots, provider)
            .build()
            .map_err(|e| unusable(e.to_string()))?;
        Ok(Self {
            ca: ca.to_owned(),
            server,
            client,
        })
    }

    /// `cert` verifies as a server for each of `spec`'s names, and as a
    /// client.
    fn check(&self, spec: &NameSpec, cert: &Cert) -> Result<(), CertsError> {
        let refused = |reason: String| CertsError::Verify {
            name: spec.name.clone(),
            ca: self.ca.clone(),
            reason,
        };
        let now = UnixTime::now();
        for n in spec.alt_names() {
            let name = ServerName::try_from(n.as_str())
                .map_err(|e| refused(format!("{n:?}: {e}")))?
                .to_owned();
            self.server
                .verify_server_cert(&cert.der, &[], &name, &[], now)
                .map_err(|e| refused(format!("as a server named {n}: {e}")))?;
        }
        self.client
            .verify_client_cert(&cert.der, &[], now)
            .map_err(|e| refused(format!("as a client: {e}")))?;
        Ok(())
    }
}

fn exists(p: &Path) -> bool {
    p.symlink_metadata().is_ok()
}

fn io(path: &Path, source: std::io::Error) -> CertsError {
    CertsError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Writes `text` to `path` with `mode`. Without `replace`, the file is
/// created only if absent (no clobbering, whatever appeared since the
/// checks); with it, written beside and renamed over, so a reader (a node
/// reloading its identity) sees the old file or the new one, and a key
/// never has a moment with the old file's mode.
fn write(path: &Path, text: &str, mode: u32, replace: bool) -> Result<(), CertsError> {
    let open = |p: &Path| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(p)
    };
    if !replace {
        let mut f = open(path).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => CertsError::Exists(path.to_owned()),
            _ => io(path, e),
        })?;
        return f
            .write_all(text.as_bytes())
            .and_then(|()| f.sync_all())
            .map_err(|e| io(path, e));
    }
    let name = path
        .file_name()
        .map_or_else(|| "certs".into(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = open(&tmp).and_then(|mut f| {
        f.write_all(text.as_bytes())?;
        f.sync_all()
    });
    let renamed = written.and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = renamed {
        let _ = std::fs::remove_file(&tmp);
        return Err(io(path, e));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
