//! `vmmalloc info`: the NVIDIA devices on this machine (NVML), what the CUDA
//! driver says about virtual memory management on each (vmm-sys), and which
//! device backends work here.
//!
//! Never fails for lack of a GPU: where NVML or the driver is missing it says
//! so in one line each and still exits 0.
//!
//! `--pytorch` adds the Python package's self-check (`python -m vmmalloc
//! --check`, python/vmmalloc/_check.py: PyTorch's version and integrations,
//! the library, `VMMALLOC_CONF`, the GPUs, a verdict), run with
//! `$VMMALLOC_PYTHON` or `python3`; where that Python or the package is
//! missing it says so in one line.
//!
//! NVML numbers every GPU of the machine; CUDA numbers only those
//! `CUDA_VISIBLE_DEVICES` lets through, in its own order. The two are matched
//! by PCI bus id (`cuDeviceGetPCIBusId` / `nvmlDeviceGetPciInfo`), else by
//! UUID (`cuDeviceGetUuid` / `nvmlDeviceGetUUID`). Every CUDA query made here
//! needs no context, and none is created on any device
//! ([`CudaDevice::probe`]).

use anyhow::Result;
use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;
use serde_json::{json, Value};
use vmm_sys::{version_string, Driver, LoadError};
use vmmalloc_device::cuda::{self, CudaDevice};
use vmmalloc_device::{DeviceCaps, GIB, MIB};

/// Arguments of `vmmalloc info`.
#[derive(clap::Args, Debug)]
pub struct InfoArgs {
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also run the Python package's self-check (`python -m vmmalloc --check`)
    /// with `$VMMALLOC_PYTHON` or `python3`: PyTorch, its integrations, a verdict.
    #[arg(long)]
    pub pytorch: bool,
}

/// The Python interpreter `--pytorch` runs, instead of `python3`.
pub const PYTHON_ENV: &str = "VMMALLOC_PYTHON";

/// Runs `vmmalloc info`.
pub fn run(args: InfoArgs) -> Result<()> {
    let nvml = probe_nvml();
    let cuda = probe_cuda();
    let backends = backends(&cuda);
    let matches = cuda_to_nvml(&nvml, &cuda);
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let pytorch = args.pytorch.then(pytorch_check);
    if args.json {
        let mut out = json!({
            "nvml": nvml.to_json(),
            "cuda": cuda.to_json(&matches),
            "cuda_visible_devices": visible,
            "backends": backends,
        });
        if let Some(p) = &pytorch {
            out["pytorch"] = match p {
                Ok((python, report)) => json!({
                    "python": python,
                    "report": report.lines().collect::<Vec<_>>(),
                    "verdict": report.lines().last(),
                }),
                Err(e) => json!({ "error": e }),
            };
        }
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        print!("{}", nvml.to_text());
        print!("{}", cuda.to_text(&matches));
        if let Some(v) = &visible {
            println!("CUDA_VISIBLE_DEVICES={v}");
        }
        println!("backends available: {}", backends.join(", "));
        match &pytorch {
            Some(Ok((python, report))) => {
                println!("PyTorch check ({python} -m vmmalloc --check):");
                print!("{report}");
            }
            Some(Err(e)) => println!("PyTorch check: {e}"),
            None => {}
        }
    }
    Ok(())
}

/// Runs `python -m vmmalloc --check` and returns (the interpreter, its
/// report), or one line saying why there is none (no such interpreter, no
/// vmmalloc package for it). The report ends with its verdict line.
fn pytorch_check() -> Result<(String, String), String> {
    let python = std::env::var(PYTHON_ENV).unwrap_or_else(|_| "python3".to_owned());
    let out = match std::process::Command::new(&python)
        .args(["-m", "vmmalloc", "--check"])
        .output()
    {
        Ok(o) => o,
        Err(e) => return Err(format!("cannot run {python} ({e}); set {PYTHON_ENV}")),
    };
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    if report
        .lines()
        .last()
        .is_some_and(|l| l.starts_with("verdict: "))
    {
        return Ok((python, report));
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let why = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no output");
    let hint = if why.contains("No module named vmmalloc") {
        format!(
            " (install the package into that Python: pip install ./python; or name the \
             Python that has it, e.g. a virtual environment's: {PYTHON_ENV}=.venv/bin/python)"
        )
    } else {
        String::new()
    };
    Err(format!(
        "{python} -m vmmalloc --check gave no verdict ({}){hint}",
        why.trim()
    ))
}

/// The device backends usable on this machine.
fn backends(cuda: &CudaReport) -> Vec<&'static str> {
    let mut out = Vec::new();
    if let CudaReport::Loaded { devices, .. } = cuda {
        if devices.iter().any(|d| d.caps.is_ok()) {
            out.push("cuda");
        }
    }
    out.extend(["host", "sim"]);
    out
}

// ---------------------------------------------------------------------------
// NVML
// ---------------------------------------------------------------------------

enum NvmlReport {
    /// The library is missing or would not initialize: one line.
    Missing { what: &'static str, why: String },
    Loaded {
        driver_version: Option<String>,
        cuda_version: Option<i32>,
        devices: Result<Vec<NvmlDevice>, String>,
    },
}

struct NvmlDevice {
    index: u32,
    /// `nvmlDeviceGetPciInfo`'s bus id, e.g. `00000000:3B:00.0`.
    pci_bus_id: Option<String>,
    /// `nvmlDeviceGetUUID`, e.g. `GPU-5f3c...`.
    uuid: Option<String>,
    name: Result<String, String>,
    /// total, free, used.
    memory: Result<(u64, u64, u64), String>,
    /// (pid, used bytes if known).
    processes: Result<Vec<(u32, Option<u64>)>, String>,
}

fn probe_nvml() -> NvmlReport {
    let nvml = match Nvml::init() {
        Ok(n) => n,
        Err(NvmlError::LibloadingError(e)) => {
            return NvmlReport::Missing {
                what: "not found",
                why: e.to_string(),
            }
        }
        Err(e) => {
            return NvmlReport::Missing {
                what: "unavailable",
                why: e.to_string(),
            }
        }
    };
    let devices = nvml.device_count().map_err(|e| e.to_string()).map(|n| {
        (0..n)
            .map(|index| match nvml.device_by_index(index) {
                Ok(d) => NvmlDevice {
                    index,
                    pci_bus_id: d.pci_info().ok().map(|p| p.bus_id),
                    uuid: d.uuid().ok(),
                    name: d.name().map_err(|e| e.to_string()),
                    memory: d
                        .memory_info()
                        .map(|m| (m.total, m.free, m.used))
                        .map_err(|e| e.to_string()),
                    processes: d
                        .running_compute_processes()
                        .map(|ps| {
                            ps.into_iter()
                                .map(|p| {
                                    let used = match p.used_gpu_memory {
                                        UsedGpuMemory::Used(b) => Some(b),
                                        UsedGpuMemory::Unavailable => None,
                                    };
                                    (p.pid, used)
                                })
                                .collect()
                        })
                        .map_err(|e| e.to_string()),
                },
                Err(e) => NvmlDevice {
                    index,
                    pci_bus_id: None,
                    uuid: None,
                    name: Err(e.to_string()),
                    memory: Err(e.to_string()),
                    processes: Err(e.to_string()),
                },
            })
            .collect()
    });
    NvmlReport::Loaded {
        driver_version: nvml.sys_driver_version().ok(),
        cuda_version: nvml.sys_cuda_driver_version().ok(),
        devices,
    }
}

impl NvmlReport {
    fn to_text(&self) -> String {
        let (driver_version, cuda_version, devices) = match self {
            NvmlReport::Missing { what, why } => return format!("NVML: {what} ({why})\n"),
            NvmlReport::Loaded {
                driver_version,
                cuda_version,
                devices,
            } => (driver_version, cuda_version, devices),
        };
        let mut s = String::from("NVML:");
        if let Some(v) = driver_version {
            s += &format!(" driver {v}");
        }
        if let Some(v) = cuda_version {
            s += &format!(", CUDA {}", version_string(*v));
        }
        let devices = match devices {
            Ok(d) => d,
            Err(e) => return format!("{s}, devices unknown ({e})\n"),
        };
        s += &format!(", {} device(s)\n", devices.len());
        for d in devices {
            let name = d.name.as_deref().unwrap_or("(name unknown)");
            let name = match &d.pci_bus_id {
                Some(b) => format!("{name} (PCI {b})"),
                None => name.to_owned(),
            };
            match &d.memory {
                Ok((total, free, used)) => {
                    s += &format!(
                        "  [{}] {name}: {} total, {} free, {} used\n",
                        d.index,
                        human(*total),
                        human(*free),
                        human(*used)
                    )
                }
                Err(e) => s += &format!("  [{}] {name}: memory unknown ({e})\n", d.index),
            }
            match &d.processes {
                Ok(ps) if ps.is_empty() => s += "      no compute processes\n",
                Ok(ps) => {
                    for (pid, used) in ps {
                        let used = used.map_or_else(|| "memory unknown".to_owned(), human);
                        s += &format!("      pid {pid}: {used}\n");
                    }
                }
                Err(e) => s += &format!("      processes unknown ({e})\n"),
            }
        }
        s
    }

    fn to_json(&self) -> Value {
        match self {
            NvmlReport::Missing { what, why } => {
                json!({ "available": false, "error": format!("{what}: {why}") })
            }
            NvmlReport::Loaded {
                driver_version,
                cuda_version,
                devices,
            } => {
                let devices = match devices {
                    Ok(ds) => Value::Array(
                        ds.iter()
                            .map(|d| {
                                json!({
                                    "index": d.index,
                                    "pci_bus_id": d.pci_bus_id,
                                    "uuid": d.uuid,
                                    "name": result_json(&d.name, |n| json!(n)),
                                    "memory": result_json(&d.memory, |(t, f, u)| {
                                        json!({ "total": t, "free": f, "used": u })
                                    }),
                                    "processes": result_json(&d.processes, |ps| {
                                        Value::Array(
                                            ps.iter()
                                                .map(|(pid, used)| {
                                                    json!({ "pid": pid, "used_bytes": used })
                                                })
                                                .collect(),
                                        )
                                    }),
                                })
                            })
                            .collect(),
                    ),
                    Err(e) => json!({ "error": e }),
                };
                json!({
                    "available": true,
                    "driver_version": driver_version,
                    "cuda_version": cuda_version,
                    "devices": devices,
                })
            }
        }
    }
}

/// The value, or `{"error": "..."}`.
fn result_json<T>(r: &Result<T, String>, f: impl FnOnce(&T) -> Value) -> Value {
    match r {
        Ok(v) => f(v),
        Err(e) => json!({ "error": e }),
    }
}

// ---------------------------------------------------------------------------
// CUDA driver
// ---------------------------------------------------------------------------

enum CudaReport {
    Missing(LoadError),
    Loaded {
        library: String,
        version: Result<i32, String>,
        devices: Vec<CudaDeviceReport>,
        /// Why devices could not be listed (e.g. no device, cuInit failed).
        problem: Option<String>,
    },
}

struct CudaDeviceReport {
    ordinal: u32,
    caps: Result<DeviceCaps, String>,
    /// `cuDeviceGetPCIBusId`, e.g. `0000:3B:00.0`.
    pci_bus_id: Option<String>,
    /// `cuDeviceGetUuid`, formatted as NVML does (`GPU-...`).
    uuid: Option<String>,
}

/// A 16-byte UUID as NVML prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
fn nvml_uuid(b: &[u8; 16]) -> String {
    let h = |r: std::ops::Range<usize>| b[r].iter().map(|x| format!("{x:02x}")).collect::<String>();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        h(0..4),
        h(4..6),
        h(6..8),
        h(8..10),
        h(10..16)
    )
}

/// A PCI bus id as `(domain, bus, device, function)`, whatever the width of
/// the domain (NVML writes 8 hex digits, CUDA 4).
fn parse_bus_id(id: &str) -> Option<(u32, u32, u32, u32)> {
    let (domain, rest) = id.trim().split_once(':')?;
    let (bus, rest) = rest.split_once(':')?;
    let (device, function) = rest.split_once('.')?;
    let hex = |s: &str| u32::from_str_radix(s.trim_matches(char::from(0)), 16).ok();
    Some((hex(domain)?, hex(bus)?, hex(device)?, hex(function)?))
}

/// For each CUDA device `(pci bus id, uuid)`, the index of the NVML device
/// `(index, pci bus id, uuid)` that is the same GPU: same PCI address, else
/// same UUID.
fn match_devices(
    cuda: &[(Option<&str>, Option<&str>)],
    nvml: &[(u32, Option<&str>, Option<&str>)],
) -> Vec<Option<u32>> {
    cuda.iter()
        .map(|(bus, uuid)| {
            let by_bus = bus.and_then(parse_bus_id).and_then(|b| {
                nvml.iter()
                    .find(|(_, nb, _)| nb.and_then(parse_bus_id) == Some(b))
                    .map(|(i, _, _)| *i)
            });
            by_bus.or_else(|| {
                uuid.and_then(|u| {
                    nvml.iter()
                        .find(|(_, _, nu)| nu.is_some_and(|nu| nu.eq_ignore_ascii_case(u)))
                        .map(|(i, _, _)| *i)
                })
            })
        })
        .collect()
}

/// The NVML index of each CUDA device (`None`: NVML missing or no match).
fn cuda_to_nvml(nvml: &NvmlReport, cuda: &CudaReport) -> Vec<Option<u32>> {
    let CudaReport::Loaded { devices, .. } = cuda else {
        return Vec::new();
    };
    let keys: Vec<_> = devices
        .iter()
        .map(|d| (d.pci_bus_id.as_deref(), d.uuid.as_deref()))
        .collect();
    let nv: Vec<_> = match nvml {
        NvmlReport::Loaded {
            devices: Ok(ds), ..
        } => ds
            .iter()
            .map(|d| (d.index, d.pci_bus_id.as_deref(), d.uuid.as_deref()))
            .collect(),
        _ => Vec::new(),
    };
    match_devices(&keys, &nv)
}

fn probe_cuda() -> CudaReport {
    let driver = match Driver::global() {
        Ok(d) => d,
        Err(e) => return CudaReport::Missing(e),
    };
    let version = cuda::driver_version().map_err(|e| e.to_string());
    let (devices, problem) = match cuda::device_count() {
        Ok(0) => (Vec::new(), Some("no CUDA device found".to_owned())),
        Ok(n) => (
            (0..n)
                .map(|ordinal| {
                    let dev = driver.device_get(ordinal as i32).ok();
                    CudaDeviceReport {
                        ordinal,
                        caps: CudaDevice::probe(driver.clone(), ordinal).map_err(|e| e.to_string()),
                        pci_bus_id: dev.and_then(|d| driver.device_get_pci_bus_id(d).ok()),
                        uuid: dev
                            .and_then(|d| driver.device_get_uuid(d).ok())
                            .map(|b| nvml_uuid(&b)),
                    }
                })
                .collect(),
            None,
        ),
        Err(e) => (Vec::new(), Some(e.to_string())),
    };
    CudaReport::Loaded {
        library: driver.path().to_owned(),
        version,
        devices,
        problem,
    }
}

impl CudaReport {
    fn to_text(&self, nvml: &[Option<u32>]) -> String {
        let (library, version, devices, problem) = match self {
            CudaReport::Missing(e @ LoadError::Library { .. }) => {
                return format!("CUDA driver: not found ({e})\n")
            }
            CudaReport::Missing(e) => return format!("CUDA driver: unusable ({e})\n"),
            CudaReport::Loaded {
                library,
                version,
                devices,
                problem,
            } => (library, version, devices, problem),
        };
        let version = match version {
            Ok(v) => format!("CUDA {} ({v})", version_string(*v)),
            Err(e) => format!("version unknown ({e})"),
        };
        let mut s = format!("CUDA driver: {version} from {library}");
        if let Some(p) = problem {
            return format!("{s}; {p}\n");
        }
        s += &format!(", {} device(s)\n", devices.len());
        for (i, d) in devices.iter().enumerate() {
            match &d.caps {
                Ok(c) => {
                    s += &format!(
                        "  [{}] {}: {} memory, VMM supported, granularity {}\n",
                        d.ordinal,
                        c.name,
                        human(c.total_memory),
                        human(c.granularity),
                    )
                }
                Err(e) => s += &format!("  [{}] unusable: {e}\n", d.ordinal),
            }
            s += &format!(
                "      PCI {}, {}, {}\n",
                d.pci_bus_id.as_deref().unwrap_or("unknown"),
                d.uuid.as_deref().unwrap_or("UUID unknown"),
                match nvml.get(i).copied().flatten() {
                    Some(n) => format!("NVML device {n}"),
                    None => "no NVML device matches".to_owned(),
                }
            );
        }
        s
    }

    fn to_json(&self, nvml: &[Option<u32>]) -> Value {
        match self {
            CudaReport::Missing(e) => json!({
                "available": false,
                "library": e.path(),
                "error": e.to_string(),
            }),
            CudaReport::Loaded {
                library,
                version,
                devices,
                problem,
            } => json!({
                "available": true,
                "library": library,
                "driver_version": version.as_ref().ok(),
                "driver_version_string": version.as_ref().ok().map(|v| version_string(*v)),
                "error": problem.clone().or_else(|| version.as_ref().err().cloned()),
                "devices": devices.iter().enumerate().map(|(i, d)| {
                    let mut v = match &d.caps {
                        Ok(c) => json!({
                            "ordinal": d.ordinal,
                            "available": true,
                            "name": c.name,
                            "total_memory": c.total_memory,
                            "granularity": c.granularity,
                            "vmm_supported": c.vmm_supported,
                        }),
                        Err(e) => json!({
                            "ordinal": d.ordinal,
                            "available": false,
                            "error": e,
                        }),
                    };
                    v["pci_bus_id"] = json!(d.pci_bus_id);
                    v["uuid"] = json!(d.uuid);
                    v["nvml_index"] = json!(nvml.get(i).copied().flatten());
                    v
                }).collect::<Vec<_>>(),
            }),
        }
    }
}

/// `2 MiB`, `79.6 GiB`, `512 B`.
fn human(bytes: u64) -> String {
    if bytes >= GIB {
        if bytes.is_multiple_of(GIB) {
            format!("{} GiB", bytes / GIB)
        } else {
            format!("{:.1} GiB", bytes as f64 / GIB as f64)
        }
    } else if bytes >= MIB {
        if bytes.is_multiple_of(MIB) {
            format!("{} MiB", bytes / MIB)
        } else {
            format!("{:.1} MiB", bytes as f64 / MIB as f64)
        }
    } else if bytes >= 1024 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_sizes() {
        assert_eq!(human(2 * MIB), "2 MiB");
        assert_eq!(human(80 * GIB), "80 GiB");
        assert_eq!(human(GIB + GIB / 2), "1.5 GiB");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 * MIB / 2), "1.5 MiB");
    }

    #[test]
    fn missing_driver_lists_cpu_backends() {
        let report = CudaReport::Missing(LoadError::Library {
            path: "/nonexistent".into(),
            reason: "cannot open shared object file".into(),
        });
        assert_eq!(backends(&report), ["host", "sim"]);
        assert_eq!(
            report.to_text(&[]),
            "CUDA driver: not found (/nonexistent: cannot open shared object file)\n"
        );
        assert_eq!(report.to_json(&[])["available"], false);
    }

    #[test]
    fn uuids_print_as_nvml_does() {
        let b = [
            0x5f, 0x3c, 0x01, 0x02, 0xaa, 0xbb, 0x4c, 0xdd, 0x80, 0x01, 1, 2, 3, 4, 5, 6,
        ];
        assert_eq!(nvml_uuid(&b), "GPU-5f3c0102-aabb-4cdd-8001-010203040506");
    }

    #[test]
    fn cuda_devices_match_nvml_by_bus_id_then_uuid() {
        assert_eq!(parse_bus_id("00000000:3B:00.0"), Some((0, 0x3b, 0, 0)));
        assert_eq!(parse_bus_id("0000:3b:00.0"), Some((0, 0x3b, 0, 0)));
        assert_eq!(parse_bus_id("nonsense"), None);
        // NVML sees four GPUs; CUDA_VISIBLE_DEVICES=2,0 shows two, in that order.
        let nvml = [
            (0, Some("00000000:1A:00.0"), Some("GPU-aaaa")),
            (1, Some("00000000:1B:00.0"), Some("GPU-bbbb")),
            (2, Some("00000000:3B:00.0"), Some("GPU-cccc")),
            (3, None, Some("GPU-dddd")),
        ];
        let cuda = [
            (Some("0000:3B:00.0"), Some("GPU-cccc")),
            (Some("0000:1a:00.0"), None),
            (None, Some("GPU-DDDD")),
            (Some("0000:99:00.0"), Some("GPU-eeee")),
        ];
        assert_eq!(
            match_devices(&cuda, &nvml),
            [Some(2), Some(0), Some(3), None]
        );
        assert_eq!(match_devices(&cuda, &[]), [None, None, None, None]);
    }
}
