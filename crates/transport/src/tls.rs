//! The cluster CA, node certificates and the mutual-TLS configs for QUIC.
//!
//! Every node holds a certificate signed by one cluster CA. The certificate
//! names the node twice: a DNS SAN equal to the node name (the server name its
//! peers dial with, so rustls checks it for us) and a URI SAN
//! `urn:flotilla:role:ROLE` (so a peer learns the role from the same verified
//! certificate instead of trusting a claim inside a message). Both ends of a
//! connection must present such a certificate; nothing else is trusted.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use flotilla_proto::Role;
use quinn::crypto::rustls::{NoInitialCipherSuite, QuicClientConfig, QuicServerConfig};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, PublicKeyData, SanType,
};
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::{VerifierBuilderError, WebPkiClientVerifier};
use x509_parser::extensions::GeneralName;

/// ALPN protocol id every Flotilla connection negotiates.
pub const ALPN: &[u8] = b"flotilla/1";

/// Prefix of the URI SAN that carries a node's role.
const ROLE_URN_PREFIX: &str = "urn:flotilla:role:";

/// File name of the CA certificate inside a TLS directory.
const CA_CERT: &str = "ca.pem";
/// File name of the CA private key inside a TLS directory.
const CA_KEY: &str = "ca.key";

/// Start of the cluster CA's common name; the rest is taken from its public key.
const CA_COMMON_NAME: &str = "Flotilla cluster CA";

/// How long a node certificate is valid unless its issuer says otherwise
/// (`flotilla certs issue --days`): a year, renewed with `--renew`.
pub const NODE_VALIDITY_DEFAULT: Duration = Duration::from_secs(365 * 86_400);
/// The longest a node certificate may be valid: ten years, half the CA's
/// life, so nodes issued in the CA's first ten years expire before the CA
/// that vouches for them.
pub const NODE_VALIDITY_MAX: Duration = Duration::from_secs(10 * 365 * 86_400);
/// How long the CA is valid.
const CA_VALIDITY: Duration = Duration::from_secs(20 * 365 * 86_400);
/// How far back validity starts, so a peer whose clock is behind the issuer's
/// still accepts a certificate issued a moment ago.
const BACKDATE: Duration = Duration::from_secs(86_400);

/// Why certificate work or a TLS setup failed.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// Reading or writing a file (or creating the directory) failed.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory involved.
        path: PathBuf,
        /// The underlying error.
        source: io::Error,
    },
    /// `init_ca` or `issue` found the file already there; nothing is overwritten.
    #[error(
        "{} already exists; refusing to overwrite it (a node's certificate is replaced with \
         `flotilla certs issue ... --renew`)",
        path.display()
    )]
    Exists {
        /// The file that exists.
        path: PathBuf,
    },
    /// A node certificate's lifetime outside what `issue_for` allows.
    #[error("a node certificate valid for {days} days: expected 1 to {max_days}")]
    Validity {
        /// Days asked for.
        days: u64,
        /// The most allowed.
        max_days: u64,
    },
    /// A file does not hold the PEM item expected (certificate or private key).
    #[error("{}: bad PEM: {source}", path.display())]
    Pem {
        /// The file that failed to parse.
        path: PathBuf,
        /// What the PEM parser said.
        source: rustls::pki_types::pem::Error,
    },
    /// The node name cannot be used as a file name and a TLS server name.
    #[error(
        "bad node name '{name}': use 1 to 63 ASCII letters, digits and inner hyphens, \
         not a number and not 'ca'"
    )]
    BadNodeName {
        /// The rejected name.
        name: String,
    },
    /// The CA files in the directory do not belong together or were not made by `init_ca`.
    #[error("CA in {}: {reason}", dir.display())]
    CaMismatch {
        /// The TLS directory.
        dir: PathBuf,
        /// What does not match.
        reason: &'static str,
    },
    /// A loaded certificate names a different node than the one asked for.
    #[error("{} names node '{found}', expected '{expected}'", path.display())]
    WrongNode {
        /// The certificate file.
        path: PathBuf,
        /// The node asked for.
        expected: String,
        /// The node the certificate names.
        found: String,
    },
    /// Generating a key or signing a certificate failed.
    #[error("certificate generation: {0}")]
    Rcgen(#[from] rcgen::Error),
    /// rustls refused a certificate, key or protocol setting.
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
    /// The client-certificate verifier could not be built (e.g. no usable CA root).
    #[error("client certificate verifier: {0}")]
    Verifier(#[from] VerifierBuilderError),
    /// The rustls config lacks the cipher suite QUIC's initial packets need.
    #[error("QUIC crypto: {0}")]
    Quic(#[from] NoInitialCipherSuite),
    /// The peer's connection carries no certificate (should not happen once verified).
    #[error("peer presented no certificate")]
    NoPeerCertificate,
    /// DER bytes that should be an X.509 certificate do not parse as one.
    #[error("certificate does not parse: {reason}")]
    BadCertificate {
        /// What the parser said.
        reason: String,
    },
    /// The certificate does not carry exactly one node name or one role.
    #[error("certificate must carry exactly one {what}, found {found}")]
    MissingIdentity {
        /// "node name (DNS SAN)" or "role (URI SAN)".
        what: &'static str,
        /// How many it carries.
        found: usize,
    },
    /// The certificate's role URI names no known role.
    #[error("certificate names unknown role '{role}'")]
    UnknownRole {
        /// The text after `urn:flotilla:role:`.
        role: String,
    },
}

/// Who is on the other end, read from their verified certificate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeIdentity {
    /// The node name (the certificate's DNS SAN).
    pub name: String,
    /// The node's role (the certificate's `urn:flotilla:role:` URI SAN).
    pub role: Role,
}

/// A node's TLS material loaded from `dir`: the CA certificate, its own certificate and key.
pub struct TlsMaterial {
    ca: CertificateDer<'static>,
    cert: CertificateDer<'static>,
    key: PrivateKeyDer<'static>,
}

impl TlsMaterial {
    /// Reads `ca.pem`, `NODE.pem` and `NODE.key` from `dir`; the certificate must name `node`.
    pub fn load(dir: &Path, node: &str) -> Result<TlsMaterial, TlsError> {
        check_node_name(node)?;
        let ca = read_cert(&dir.join(CA_CERT))?;
        let cert_path = dir.join(format!("{node}.pem"));
        let cert = read_cert(&cert_path)?;
        let key_path = dir.join(format!("{node}.key"));
        let key =
            PrivateKeyDer::from_pem_slice(&read(&key_path)?).map_err(|source| TlsError::Pem {
                path: key_path,
                source,
            })?;
        let m = TlsMaterial { ca, cert, key };
        // Files copied under the wrong name would otherwise surface much later as
        // a peer rejecting our server name.
        let found = m.identity()?.name;
        if found != node {
            return Err(TlsError::WrongNode {
                path: cert_path,
                expected: node.to_owned(),
                found,
            });
        }
        Ok(m)
    }

    /// This node's identity, read from its own certificate.
    pub fn identity(&self) -> Result<NodeIdentity, TlsError> {
        identity_of(&self.cert)
    }

    /// The cluster CA as the only trust root.
    fn roots(&self) -> Result<Arc<RootCertStore>, TlsError> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca.clone())?;
        Ok(Arc::new(roots))
    }
}

/// Writes a new cluster CA into `dir` (creating dir): `ca.pem` and `ca.key` (key file mode 0600 on unix). Refuses if ca.pem or ca.key exists.
pub fn init_ca(dir: &Path) -> Result<(), TlsError> {
    fs::create_dir_all(dir).map_err(|source| io_err(dir, source))?;
    let cert_path = dir.join(CA_CERT);
    let key_path = dir.join(CA_KEY);
    refuse_existing(&[&cert_path, &key_path])?;

    let key = KeyPair::generate()?;
    let mut params = ca_params(&key);
    set_validity(&mut params, CA_VALIDITY);
    let cert = params.self_signed(&key)?;
    write_pair(&cert_path, cert.pem().as_bytes(), &key_path, &key)
}

/// Issues a node certificate signed by the CA in `dir`: writes `NODE.pem` and `NODE.key` (0600); refuses to overwrite.
///
/// The certificate carries a DNS SAN equal to the node name, a URI SAN
/// `urn:flotilla:role:ROLE`, is valid for a year ([`NODE_VALIDITY_DEFAULT`]) and may be used for
/// both TLS server and client auth.
pub fn issue(dir: &Path, node: &str, role: Role) -> Result<(), TlsError> {
    issue_for(dir, node, role, NODE_VALIDITY_DEFAULT, false).map(|_| ())
}

/// As [`issue`], valid for `validity` (a day to [`NODE_VALIDITY_MAX`]);
/// `renew` replaces the node's existing certificate and key (a new key;
/// each file swapped in whole by a rename, so a reader sees the old pair
/// or the new one) instead of refusing. Returns the end of the validity.
/// A running node reads its certificate at start: restart it to use the
/// new one.
pub fn issue_for(
    dir: &Path,
    node: &str,
    role: Role,
    validity: Duration,
    renew: bool,
) -> Result<std::time::SystemTime, TlsError> {
    check_node_name(node)?;
    if validity < Duration::from_secs(86_400) || validity > NODE_VALIDITY_MAX {
        return Err(TlsError::Validity {
            days: validity.as_secs() / 86_400,
            max_days: NODE_VALIDITY_MAX.as_secs() / 86_400,
        });
    }
    let cert_path = dir.join(format!("{node}.pem"));
    let key_path = dir.join(format!("{node}.key"));
    if !renew {
        refuse_existing(&[&cert_path, &key_path])?;
    }

    let ca_cert_path = dir.join(CA_CERT);
    let ca_key_path = dir.join(CA_KEY);
    let ca_der = read_cert(&ca_cert_path)?;
    let ca_key_pem = String::from_utf8(read(&ca_key_path)?).map_err(|e| TlsError::Io {
        path: ca_key_path.clone(),
        source: io::Error::new(io::ErrorKind::InvalidData, e),
    })?;
    let ca_key = KeyPair::from_pem(&ca_key_pem)?;
    let (_, ca_x509) = parse_x509(&ca_der)?;
    // A key that does not match the CA certificate would sign node certificates
    // that every peer rejects; catch it here, where the cause is plain.
    if ca_x509.public_key().subject_public_key.data.as_ref() != ca_key.der_bytes() {
        return Err(TlsError::CaMismatch {
            dir: dir.to_owned(),
            reason: "ca.key is not the key of ca.pem",
        });
    }
    // rcgen can only read an issuer back from a certificate with its x509-parser
    // feature; the CA's name follows from its key (`ca_params`), so rebuild it.
    let issuer = Issuer::new(ca_params(&ca_key), ca_key);

    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, node);
    params.subject_alt_names = vec![
        SanType::DnsName(node.try_into()?),
        SanType::URI(format!("{ROLE_URN_PREFIX}{}", role.as_str()).try_into()?),
    ];
    params.is_ca = IsCa::NoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    set_validity(&mut params, validity);
    let not_after = std::time::UNIX_EPOCH
        + Duration::from_secs(params.not_after.unix_timestamp().max(0) as u64);
    let cert = params.signed_by(&key, &issuer)?;

    // Paired with the key check above: the issuer name we rebuilt must be the
    // CA's subject byte for byte, or chain building fails on every peer.
    let (_, node_x509) = parse_x509(cert.der())?;
    if node_x509.issuer().as_raw() != ca_x509.subject().as_raw() {
        return Err(TlsError::CaMismatch {
            dir: dir.to_owned(),
            reason: "ca.pem was not made by init_ca (its subject differs)",
        });
    }
    if renew {
        // New files beside the old, then renamed over them: key first, so
        // a node that starts in between fails the key check loudly rather
        // than running on a mismatched pair for long.
        let (cert_new, key_new) = (
            dir.join(format!(".{node}.pem.new")),
            dir.join(format!(".{node}.key.new")),
        );
        let _ = fs::remove_file(&cert_new);
        let _ = fs::remove_file(&key_new);
        write_pair(&cert_new, cert.pem().as_bytes(), &key_new, &key)?;
        fs::rename(&key_new, &key_path).map_err(|source| io_err(&key_path, source))?;
        fs::rename(&cert_new, &cert_path).map_err(|source| io_err(&cert_path, source))?;
        return Ok(not_after);
    }
    write_pair(&cert_path, cert.pem().as_bytes(), &key_path, &key)?;
    Ok(not_after)
}

/// The serial number of `NODE.pem` in `dir` (see [`serial_of`]): what a
/// revocation list names to revoke this certificate and no other.
pub fn node_serial(dir: &Path, node: &str) -> Result<String, TlsError> {
    check_node_name(node)?;
    serial_of(&read_cert(&dir.join(format!("{node}.pem")))?)
}

/// True when `dir` already holds the CA certificate and this node's cert and key.
pub fn has_node(dir: &Path, node: &str) -> bool {
    // Only the CA certificate: the CA key may live on one admin machine only.
    check_node_name(node).is_ok()
        && dir.join(CA_CERT).is_file()
        && dir.join(format!("{node}.pem")).is_file()
        && dir.join(format!("{node}.key")).is_file()
}

/// QUIC server config that requires a client certificate chaining to the cluster CA; ALPN set.
pub fn server_config(
    m: &TlsMaterial,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ServerConfig, TlsError> {
    let provider = provider();
    // `build()` without `allow_unauthenticated()` makes a client certificate mandatory.
    let verifier =
        WebPkiClientVerifier::builder_with_provider(m.roots()?, provider.clone()).build()?;
    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![m.cert.clone()], m.key.clone_key())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(QuicServerConfig::try_from(tls)?));
    cfg.transport_config(transport);
    Ok(cfg)
}

/// QUIC client config that verifies the server against the cluster CA only and presents this node's certificate; ALPN set.
pub fn client_config(
    m: &TlsMaterial,
    transport: Arc<quinn::TransportConfig>,
) -> Result<quinn::ClientConfig, TlsError> {
    let mut tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_root_certificates(m.roots()?)
        .with_client_auth_cert(vec![m.cert.clone()], m.key.clone_key())?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let mut cfg = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls)?));
    cfg.transport_config(transport);
    Ok(cfg)
}

/// The verified peer's identity on an established connection.
pub fn peer_identity(conn: &quinn::Connection) -> Result<NodeIdentity, TlsError> {
    let any = conn.peer_identity().ok_or(TlsError::NoPeerCertificate)?;
    // quinn's rustls session hands the chain out as this exact type.
    let chain = any
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| TlsError::NoPeerCertificate)?;
    let leaf = chain.first().ok_or(TlsError::NoPeerCertificate)?;
    identity_of(leaf)
}

/// The verified peer's certificate serial number, as lower-case hex with
/// colons (as `flotilla certs issue` prints it).
pub fn peer_serial(conn: &quinn::Connection) -> Result<String, TlsError> {
    let any = conn.peer_identity().ok_or(TlsError::NoPeerCertificate)?;
    let chain = any
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| TlsError::NoPeerCertificate)?;
    let leaf = chain.first().ok_or(TlsError::NoPeerCertificate)?;
    serial_of(leaf)
}

/// A DER certificate's serial number, lower-case hex bytes joined by colons.
pub fn serial_of(cert_der: &[u8]) -> Result<String, TlsError> {
    let (_, cert) = parse_x509(cert_der)?;
    Ok(cert
        .raw_serial()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":"))
}

/// Identity from a DER certificate: its one DNS SAN and its one role URI SAN.
pub fn identity_of(cert_der: &[u8]) -> Result<NodeIdentity, TlsError> {
    let (_, cert) = parse_x509(cert_der)?;
    let san = cert
        .subject_alternative_name()
        .map_err(|e| TlsError::BadCertificate {
            reason: e.to_string(),
        })?;
    let general_names = san.map(|s| s.value.general_names.as_slice()).unwrap_or(&[]);
    let mut names = Vec::new();
    let mut roles = Vec::new();
    for gn in general_names {
        match gn {
            GeneralName::DNSName(d) => names.push(*d),
            GeneralName::URI(u) => {
                if let Some(r) = u.strip_prefix(ROLE_URN_PREFIX) {
                    roles.push(r);
                }
            }
            _ => {}
        }
    }
    // Exactly one of each: with two names or two roles, which one a peer acted
    // on would depend on SAN order.
    let (&[name], &[role]) = (names.as_slice(), roles.as_slice()) else {
        return Err(if names.len() != 1 {
            TlsError::MissingIdentity {
                what: "node name (DNS SAN)",
                found: names.len(),
            }
        } else {
            TlsError::MissingIdentity {
                what: "role (URI SAN)",
                found: roles.len(),
            }
        });
    };
    check_node_name(name)?;
    let role = role.parse::<Role>().map_err(|_| TlsError::UnknownRole {
        role: role.to_owned(),
    })?;
    Ok(NodeIdentity {
        name: name.to_owned(),
        role,
    })
}

/// The ring provider, named explicitly so no process-wide default is needed or consulted.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The CA's parameters; `issue` relies on them following from the key alone.
fn ca_params(key: &KeyPair) -> CertificateParams {
    // Each CA gets its own name, taken from its public key: with one fixed name,
    // a certificate from another cluster's CA would match ours by name and be
    // refused as `BadSignature`; with distinct names it is `UnknownIssuer`, which
    // tells the operator what is wrong.
    let public = key.der_bytes();
    let tag: String = public[public.len().saturating_sub(8)..]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut params = CertificateParams::default();
    params.distinguished_name = rcgen::DistinguishedName::new();
    params
        .distinguished_name
        .push(DnType::CommonName, format!("{CA_COMMON_NAME} {tag}"));
    // Path length 0: the CA signs node certificates only, never another CA.
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params
}

/// Sets validity from one day ago for `len`.
fn set_validity(params: &mut CertificateParams, len: Duration) {
    // Wall-clock time is right here: certificate validity is checked against
    // peers' wall clocks, and issuing is an offline admin step, not core logic.
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    params.not_before = rcgen::date_time_ymd(1970, 1, 1) + since_epoch.saturating_sub(BACKDATE);
    params.not_after = params.not_before + len;
}

/// Checks `node` against `[A-Za-z0-9-]{1,63}` and that rustls takes it as a DNS server name.
fn check_node_name(node: &str) -> Result<(), TlsError> {
    let charset = (1..=63).contains(&node.len())
        && node.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    // The name is also the server name peers dial with: rustls rejects a leading
    // or trailing hyphen and all-numeric labels, so refuse them at issue time
    // rather than at the first dial. "ca" would collide with ca.pem / ca.key
    // (case-insensitively, for case-insensitive file systems).
    let ok = charset
        && matches!(ServerName::try_from(node), Ok(ServerName::DnsName(_)))
        && !node.eq_ignore_ascii_case("ca");
    if ok {
        Ok(())
    } else {
        Err(TlsError::BadNodeName {
            name: node.to_owned(),
        })
    }
}

/// Parses DER as X.509, mapping the parser's error.
fn parse_x509(
    der: &[u8],
) -> Result<(&[u8], x509_parser::certificate::X509Certificate<'_>), TlsError> {
    x509_parser::parse_x509_certificate(der).map_err(|e| TlsError::BadCertificate {
        reason: e.to_string(),
    })
}

/// Reads the first certificate of a PEM file.
fn read_cert(path: &Path) -> Result<CertificateDer<'static>, TlsError> {
    CertificateDer::from_pem_slice(&read(path)?).map_err(|source| TlsError::Pem {
        path: path.to_owned(),
        source,
    })
}

/// Reads a whole file, naming it on error.
fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    fs::read(path).map_err(|source| io_err(path, source))
}

fn io_err(path: &Path, source: io::Error) -> TlsError {
    TlsError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Fails with `Exists` on the first of `paths` that is already there.
fn refuse_existing(paths: &[&Path]) -> Result<(), TlsError> {
    match paths.iter().find(|p| p.exists()) {
        Some(p) => Err(TlsError::Exists {
            path: p.to_path_buf(),
        }),
        None => Ok(()),
    }
}

/// Writes a key (0600) then its certificate, removing the key again if the certificate cannot be written.
fn write_pair(
    cert_path: &Path,
    cert_pem: &[u8],
    key_path: &Path,
    key: &KeyPair,
) -> Result<(), TlsError> {
    write_new(key_path, key.serialize_pem().as_bytes(), true)?;
    if let Err(e) = write_new(cert_path, cert_pem, false) {
        // A lone key would make the next attempt refuse with `Exists`.
        let _ = fs::remove_file(key_path);
        return Err(e);
    }
    Ok(())
}

/// Creates `path` (never overwriting) and writes `contents`; `secret` makes it mode 0600 on unix.
fn write_new(path: &Path, contents: &[u8], secret: bool) -> Result<(), TlsError> {
    let mut opts = OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        // Set at creation, so the key is never readable by others even briefly.
        opts.mode(0o600);
    }
    #[cfg(not(unix))]
    let _ = secret;
    // `create_new` also closes the gap between `refuse_existing` and here.
    let mut file = opts.open(path).map_err(|source| {
        if source.kind() == io::ErrorKind::AlreadyExists {
            TlsError::Exists {
                path: path.to_owned(),
            }
        } else {
            io_err(path, source)
        }
    })?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .map_err(|source| io_err(path, source))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::IntoFuture;
    use std::net::SocketAddr;

    /// Upper bound on any single network step, so a regression fails instead of hanging.
    const STEP: Duration = Duration::from_secs(3);

    async fn within<F: IntoFuture>(f: F) -> F::Output {
        tokio::time::timeout(STEP, f.into_future())
            .await
            .expect("network step timed out")
    }

    fn transport() -> Arc<quinn::TransportConfig> {
        Arc::new(quinn::TransportConfig::default())
    }

    fn localhost() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 0))
    }

    fn server(m: &TlsMaterial) -> quinn::Endpoint {
        quinn::Endpoint::server(server_config(m, transport()).unwrap(), localhost()).unwrap()
    }

    /// A CA with the given nodes issued, in a fresh temporary directory.
    fn cluster(nodes: &[(&str, Role)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        init_ca(dir.path()).unwrap();
        for (node, role) in nodes {
            issue(dir.path(), node, *role).unwrap();
        }
        dir
    }

    /// Dials `server` from a fresh client endpoint and runs one echo; returns the
    /// server's accept result and the client's result (handshake through echo).
    async fn dial_and_echo(
        server: &quinn::Endpoint,
        client: quinn::ClientConfig,
        server_name: &str,
    ) -> (
        Result<NodeIdentity, String>,
        Result<(NodeIdentity, Vec<u8>), String>,
    ) {
        let addr = server.local_addr().unwrap();
        let client_ep = quinn::Endpoint::client(localhost()).unwrap();
        let serve = async {
            let incoming = within(server.accept()).await.expect("endpoint closed");
            let conn = within(incoming).await.map_err(|e| e.to_string())?;
            let who = peer_identity(&conn).map_err(|e| e.to_string())?;
            let (mut send, mut recv) = within(conn.accept_bi()).await.map_err(|e| e.to_string())?;
            let msg = within(recv.read_to_end(1024))
                .await
                .map_err(|e| e.to_string())?;
            send.write_all(&msg).await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            // Hold the connection until the client has read the echo and closed.
            within(conn.closed()).await;
            Ok(who)
        };
        let dial = async {
            let connecting = client_ep
                .connect_with(client, addr, server_name)
                .map_err(|e| e.to_string())?;
            let conn = within(connecting)
                .await
                .map_err(|e| format!("handshake: {e}"))?;
            // Past the handshake, say how the connection ended: a stream error
            // alone reads "connection lost" and hides the server's reason.
            let lost = |e: &dyn std::fmt::Display| {
                format!(
                    "after handshake: {e}; close reason: {:?}",
                    conn.close_reason()
                )
            };
            let who = peer_identity(&conn).map_err(|e| lost(&e))?;
            let (mut send, mut recv) = within(conn.open_bi()).await.map_err(|e| lost(&e))?;
            send.write_all(b"ping").await.map_err(|e| lost(&e))?;
            send.finish().map_err(|e| lost(&e))?;
            let echo = within(recv.read_to_end(1024)).await.map_err(|e| lost(&e))?;
            conn.close(0u32.into(), b"done");
            Ok((who, echo))
        };
        let (served, dialed) = tokio::join!(serve, dial);
        client_ep.wait_idle().await;
        (served, dialed)
    }

    #[tokio::test]
    async fn mutual_tls_names_both_peers_and_echoes() {
        let dir = cluster(&[("router", Role::Router), ("worker-1", Role::Worker)]);
        let router = TlsMaterial::load(dir.path(), "router").unwrap();
        let worker = TlsMaterial::load(dir.path(), "worker-1").unwrap();
        let router_id = NodeIdentity {
            name: "router".into(),
            role: Role::Router,
        };
        let worker_id = NodeIdentity {
            name: "worker-1".into(),
            role: Role::Worker,
        };
        assert_eq!(worker.identity().unwrap(), worker_id);

        let server = server(&worker);
        let client = client_config(&router, transport()).unwrap();
        let (served, dialed) = dial_and_echo(&server, client, "worker-1").await;
        assert_eq!(served.unwrap(), router_id);
        let (client_saw, echo) = dialed.unwrap();
        assert_eq!(client_saw, worker_id);
        assert_eq!(echo, b"ping");
    }

    #[test]
    fn files_are_never_overwritten_and_names_are_checked() {
        let dir = cluster(&[("worker-1", Role::Worker)]);
        let ca_before = fs::read(dir.path().join(CA_CERT)).unwrap();

        let err = init_ca(dir.path()).unwrap_err();
        assert!(
            matches!(&err, TlsError::Exists { path } if path.ends_with(CA_CERT)),
            "{err}"
        );
        assert!(err.to_string().contains("ca.pem"), "{err}");
        assert_eq!(fs::read(dir.path().join(CA_CERT)).unwrap(), ca_before);

        let err = issue(dir.path(), "worker-1", Role::Decode).unwrap_err();
        assert!(err.to_string().contains("worker-1.pem"), "{err}");
        // The refused re-issue left the old role in place.
        let m = TlsMaterial::load(dir.path(), "worker-1").unwrap();
        assert_eq!(m.identity().unwrap().role, Role::Worker);

        for bad in [
            "",
            "a.b",
            "../x",
            "white space",
            "-lead",
            "trail-",
            "123",
            "ca",
            "CA",
        ] {
            let err = issue(dir.path(), bad, Role::Worker).unwrap_err();
            assert!(
                matches!(err, TlsError::BadNodeName { .. }),
                "{bad:?}: {err}"
            );
            assert!(!has_node(dir.path(), bad));
        }
        let long = "n".repeat(64);
        assert!(matches!(
            issue(dir.path(), &long, Role::Worker),
            Err(TlsError::BadNodeName { .. })
        ));
        let max = "n".repeat(63);
        issue(dir.path(), &max, Role::Prefill).unwrap();

        assert!(has_node(dir.path(), "worker-1"));
        assert!(!has_node(dir.path(), "worker-2"));

        #[cfg(unix)]
        for key in [CA_KEY, "worker-1.key"] {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.path().join(key))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600, "{key}");
        }
    }

    /// Seconds from now to a certificate file's notAfter.
    fn secs_left(path: &Path) -> i64 {
        let der = read_cert(path).unwrap();
        let (_, x) = parse_x509(&der).unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        x.validity().not_after.timestamp() - now
    }

    /// A node certificate lasts a year by default, as long as asked within
    /// bounds; `renew` replaces the pair with a new key and lifetime (still
    /// accepted by a peer of the same CA), and without it an existing pair
    /// is refused with the way to renew.
    #[test]
    fn node_certificates_last_a_year_unless_asked_and_renew_in_place() {
        let dir = cluster(&[("worker-1", Role::Worker)]);
        let day = 86_400i64;
        let left = secs_left(&dir.path().join("worker-1.pem"));
        // Backdated a day: 364 days and change from now.
        assert!((363 * day..=365 * day).contains(&left), "{left}");
        let old_key = fs::read(dir.path().join("worker-1.key")).unwrap();
        let err = issue_for(
            dir.path(),
            "worker-1",
            Role::Worker,
            NODE_VALIDITY_DEFAULT,
            false,
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("already exists") && err.contains("--renew"),
            "{err}"
        );
        let until = issue_for(
            dir.path(),
            "worker-1",
            Role::Worker,
            Duration::from_secs(30 * 86_400),
            true,
        )
        .unwrap();
        let left = secs_left(&dir.path().join("worker-1.pem"));
        assert!((28 * day..=30 * day).contains(&left), "{left}");
        let until_left = until
            .duration_since(std::time::SystemTime::now())
            .unwrap()
            .as_secs() as i64;
        assert!((until_left - left).abs() <= 5, "{until_left} vs {left}");
        assert_ne!(fs::read(dir.path().join("worker-1.key")).unwrap(), old_key);
        // The renewed pair loads and still names its role; no temporary
        // file is left behind.
        let m = TlsMaterial::load(dir.path(), "worker-1").unwrap();
        drop(m);
        let names: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.ends_with(".new")), "{names:?}");
        for bad in [0u64, 20 * 365] {
            let e = issue_for(
                dir.path(),
                "worker-2",
                Role::Worker,
                Duration::from_secs(bad * 86_400),
                false,
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("expected 1 to 3650"), "{e}");
        }
    }

    #[test]
    fn issue_without_ca_names_the_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = issue(dir.path(), "worker-1", Role::Worker).unwrap_err();
        assert!(
            matches!(&err, TlsError::Io { path, .. } if path.ends_with(CA_CERT)),
            "{err}"
        );
    }

    #[test]
    fn issue_rejects_a_key_that_is_not_the_cas() {
        let a = cluster(&[]);
        let b = cluster(&[]);
        fs::copy(b.path().join(CA_KEY), a.path().join(CA_KEY)).unwrap();
        let err = issue(a.path(), "worker-1", Role::Worker).unwrap_err();
        assert!(matches!(err, TlsError::CaMismatch { .. }), "{err}");
    }

    #[test]
    fn identity_rejects_certificates_without_a_role() {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(vec!["worker-1".to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let err = identity_of(cert.der()).unwrap_err();
        assert!(
            matches!(err, TlsError::MissingIdentity { found: 0, .. }),
            "{err}"
        );

        let mut params = CertificateParams::new(vec!["worker-1".to_owned()]).unwrap();
        params
            .subject_alt_names
            .push(SanType::URI("urn:flotilla:role:gpu".try_into().unwrap()));
        let cert = params.self_signed(&key).unwrap();
        let err = identity_of(cert.der()).unwrap_err();
        assert!(
            matches!(&err, TlsError::UnknownRole { role } if role == "gpu"),
            "{err}"
        );

        assert!(matches!(
            identity_of(b"not der"),
            Err(TlsError::BadCertificate { .. })
        ));
    }

    #[tokio::test]
    async fn client_without_certificate_is_refused() {
        let dir = cluster(&[("worker-1", Role::Worker)]);
        let worker = TlsMaterial::load(dir.path(), "worker-1").unwrap();
        let mut tls = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(worker.roots().unwrap())
            .with_no_client_auth();
        tls.alpn_protocols = vec![ALPN.to_vec()];
        let client = quinn::ClientConfig::new(Arc::new(QuicClientConfig::try_from(tls).unwrap()));

        let server = server(&worker);
        let (served, dialed) = dial_and_echo(&server, client, "worker-1").await;
        let served = served.unwrap_err();
        let dialed = dialed.unwrap_err();
        assert!(
            served.contains("peer sent no certificates"),
            "server: {served}"
        );
        // In TLS 1.3 the client's handshake is done once it sends its Finished,
        // before the server has looked at the (empty) client certificate: the
        // refusal reaches the client only as the connection closing under its
        // first stream, carrying the server's reason (certificate_required).
        assert!(dialed.starts_with("after handshake"), "client: {dialed}");
        assert!(
            dialed.contains("peer sent no certificates"),
            "client: {dialed}"
        );
    }

    #[tokio::test]
    async fn certificates_from_another_ca_are_refused() {
        let ours = cluster(&[("router", Role::Router), ("worker-1", Role::Worker)]);
        let theirs = cluster(&[("router", Role::Router), ("worker-1", Role::Worker)]);
        let load = |dir: &tempfile::TempDir, node| TlsMaterial::load(dir.path(), node).unwrap();

        // Server side: the client trusts our CA (so it would accept the server)
        // but presents a certificate from theirs.
        let server_ep = server(&load(&ours, "worker-1"));
        let foreign_client = TlsMaterial {
            ca: load(&ours, "router").ca,
            ..load(&theirs, "router")
        };
        let client = client_config(&foreign_client, transport()).unwrap();
        let (served, dialed) = dial_and_echo(&server_ep, client, "worker-1").await;
        let served = served.unwrap_err();
        let dialed = dialed.unwrap_err();
        assert!(served.contains("UnknownIssuer"), "server: {served}");
        assert!(dialed.contains("UnknownIssuer"), "client: {dialed}");

        // Client side: the server trusts our CA (so it would accept the client)
        // but presents a certificate from theirs.
        let foreign_server = TlsMaterial {
            ca: load(&ours, "worker-1").ca,
            ..load(&theirs, "worker-1")
        };
        let server_ep = server(&foreign_server);
        let client = client_config(&load(&ours, "router"), transport()).unwrap();
        let (served, dialed) = dial_and_echo(&server_ep, client, "worker-1").await;
        let served = served.unwrap_err();
        let dialed = dialed.unwrap_err();
        assert!(dialed.starts_with("handshake"), "client: {dialed}");
        assert!(dialed.contains("UnknownIssuer"), "client: {dialed}");
        assert!(served.contains("UnknownIssuer"), "server: {served}");
    }
}
