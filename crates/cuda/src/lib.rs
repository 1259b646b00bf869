//! Flotilla's CUDA backend: the executor on NVIDIA GPUs through cudarc,
//! with the kernels of `kernels/` compiled at run time by NVRTC for the
//! device's compute capability and GEMMs through cuBLAS.
//!
//! cudarc loads libcuda, libnvrtc and libcublas when first used, so this
//! crate builds and the binary runs on machines without CUDA; every entry
//! point checks that the libraries are present first (cudarc would panic)
//! and says what is missing.

pub mod exec;
pub mod kernels;

pub use exec::{CudaConfig, CudaError, CudaExecutor, driver_present, probe};

/// Where a model runs: `cpu`, or `cuda` / `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend.
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device '{s}' (expected cpu, cuda or cuda:N)")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", ""] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.contains("expected cpu, cuda or cuda:N"), "{bad}: {e}");
        }
    }
}
