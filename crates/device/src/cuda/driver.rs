//! The process-wide driver and its errors: loading it, counting devices,
//! and turning a failed call into a [`DeviceError`] (see the parent module's
//! "Errors").

use super::*;

/// The process-wide driver ([`Driver::global`]), or `Unavailable` saying why not.
pub(super) fn global_driver() -> DeviceResult<Arc<Driver>> {
    Driver::global().map_err(|e| unavailable_load(&e))
}

/// Number of CUDA devices visible to this process (0 when the driver is
/// installed but finds no device).
pub fn device_count() -> DeviceResult<u32> {
    let driver = global_driver()?;
    match driver.init(0) {
        Ok(()) => {}
        Err(e) if e.code == CUDA_ERROR_NO_DEVICE => return Ok(0),
        Err(e) => return Err(DeviceError::Unavailable(describe(&driver, e))),
    }
    let n = driver
        .device_get_count()
        .map_err(|e| DeviceError::Unavailable(describe(&driver, e)))?;
    Ok(u32::try_from(n).unwrap_or(0))
}

/// The driver's CUDA version (`cuDriverGetVersion`), e.g. 12080 for 12.8
/// (format it with [`vmm_sys::version_string`]).
pub fn driver_version() -> DeviceResult<i32> {
    let driver = global_driver()?;
    driver
        .driver_get_version()
        .map_err(|e| DeviceError::Unavailable(describe(&driver, e)))
}

/// One line saying why the driver library could not be used.
pub(super) fn unavailable_load(e: &LoadError) -> DeviceError {
    DeviceError::Unavailable(match e {
        LoadError::Library { .. } => format!("CUDA driver not found ({e})"),
        LoadError::Symbol { .. } => format!("CUDA driver unusable ({e})"),
    })
}

/// `"cuInit: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected"`.
pub(super) fn describe(driver: &Driver, e: CuError) -> String {
    let name = code_name(driver, e.code);
    match driver.error_string(e.code) {
        Some(text) => format!("{}: {name} ({}): {text}", e.call, e.code),
        None => format!("{}: {name} ({})", e.call, e.code),
    }
}

/// The driver's name for a code, else ours, else the number.
pub(super) fn code_name(driver: &Driver, code: u32) -> String {
    driver
        .error_name(code)
        .or_else(|| result_name(code).map(str::to_owned))
        .unwrap_or_else(|| format!("CUresult {code}"))
}

/// Builds [`DeviceError::Driver`] from a failed call (pure, for testing).
pub(super) fn driver_error(
    call: Call,
    e: CuError,
    name: String,
    text: Option<String>,
    args: &str,
) -> DeviceError {
    let mut detail = format!("{}({args})", e.call);
    if let Some(text) = text {
        detail.push_str(": ");
        detail.push_str(&text);
    }
    DeviceError::Driver {
        call,
        code: e.code,
        name,
        detail,
    }
}
