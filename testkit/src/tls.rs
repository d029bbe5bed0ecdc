//! A throwaway certificate authority for the mutual-TLS tests: a CA
//! certificate, and node certificates it signs (valid now, or expired),
//! written as PEM files the way an operator's PKI would hand them out.
//! Keys are ECDSA P-256 (rcgen's default), fresh per call.

use std::path::{Path, PathBuf};

use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, CertifiedIssuer, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
};

/// What a test CA could not do (rcgen's error, or the file system's).
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// A node certificate's validity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Validity {
    /// From 2020 to 2100.
    Current,
    /// From 2020 to 2021: expired.
    Expired,
}

/// The three files of a node's identity.
#[derive(Clone, Debug)]
pub struct NodeFiles {
    /// The CA's certificate.
    pub ca: PathBuf,
    /// The node's certificate.
    pub cert: PathBuf,
    /// The node's private key.
    pub key: PathBuf,
}

/// A certificate authority.
#[derive(Debug)]
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    /// Its certificate's file.
    pub ca_file: PathBuf,
}

impl TestCa {
    /// A new CA named `name`, its certificate written to `dir/NAME-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Result<Self, Error> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(DnType::CommonName, format!("{name} CA"));
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        p.not_before = date_time_ymd(2020, 1, 1);
        p.not_after = date_time_ymd(2100, 1, 1);
        let issuer = CertifiedIssuer::self_signed(p, KeyPair::generate()?)?;
        let ca_file = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&ca_file, issuer.pem())?;
        Ok(Self { issuer, ca_file })
    }

    /// A node certificate for `names` (DNS names or IP addresses, as its
    /// peers dial it), usable as server and client: its certificate and
    /// key as PEM text.
    pub fn node_pem(&self, names: &[&str], validity: Validity) -> Result<(String, String), Error> {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut p = CertificateParams::new(names.clone())?;
        p.distinguished_name.push(
            DnType::CommonName,
            names.first().cloned().unwrap_or_default(),
        );
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.not_before = date_time_ymd(2020, 1, 1);
        p.not_after = match validity {
            Validity::Current => date_time_ymd(2100, 1, 1),
            Validity::Expired => date_time_ymd(2021, 1, 1),
        };
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.issuer)?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// [`TestCa::node_pem`], written to `dir/STEM.pem` and
    /// `dir/STEM-key.pem` (owner-only), with this CA's file.
    pub fn write_node(
        &self,
        dir: &Path,
        stem: &str,
        names: &[&str],
        validity: Validity,
    ) -> Result<NodeFiles, Error> {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let (cert, key) = self.node_pem(names, validity)?;
        let cert_file = dir.join(format!("{stem}.pem"));
        let key_file = dir.join(format!("{stem}-key.pem"));
        std::fs::write(&cert_file, cert)?;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&key_file)?
            .write_all(key.as_bytes())?;
        Ok(NodeFiles {
            ca: self.ca_file.clone(),
            cert: cert_file,
            key: key_file,
        })
    }
}
