//! Naming and building policies.

use crate::{AllocError, AllocResult, Allocator};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use vmmalloc_device::Device;

/// The allocation policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Policy {
    /// Ours: page-level reclaim, page pool, one arena per device.
    Expandable,
    /// PyTorch's plain caching allocator.
    Caching,
    /// PyTorch's `expandable_segments:True`.
    TorchEs,
    /// One device allocation per request.
    Native,
}

impl Policy {
    /// Every policy, ours first.
    pub const ALL: [Policy; 4] = [
        Policy::Expandable,
        Policy::Caching,
        Policy::TorchEs,
        Policy::Native,
    ];

    /// The policy's name as used on the command line and in VMMALLOC_CONF.
    pub fn name(self) -> &'static str {
        match self {
            Policy::Expandable => "expandable",
            Policy::Caching => "caching",
            Policy::TorchEs => "torch-es",
            Policy::Native => "native",
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Policy {
    type Err = AllocError;
    fn from_str(s: &str) -> AllocResult<Policy> {
        Policy::ALL
            .iter()
            .copied()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                AllocError::InvalidOption(format!(
                    "unknown policy `{s}`; valid policies: {}",
                    Policy::ALL.map(Policy::name).join(", ")
                ))
            })
    }
}

/// Options shared by the policies; each policy reads the ones it knows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PolicyOptions {
    /// `expandable`: options of our allocator.
    pub expandable: crate::expandable::ExpandableConfig,
    /// `caching` and `torch-es`: PyTorch's allocator options.
    pub caching: crate::caching::CachingConfig,
}

/// Builds a policy over a device.
pub fn build(
    policy: Policy,
    device: Arc<dyn Device>,
    options: &PolicyOptions,
) -> AllocResult<Box<dyn Allocator>> {
    Ok(match policy {
        Policy::Expandable => Box::new(crate::expandable::ExpandableAllocator::new(
            device,
            options.expandable.clone(),
        )?),
        Policy::Caching => Box::new(crate::caching::CachingAllocator::new(
            device,
            options.caching.clone(),
        )?),
        Policy::TorchEs => Box::new(crate::torch_es::TorchEsAllocator::new(
            device,
            options.caching.clone(),
        )?),
        Policy::Native => Box::new(crate::native::NativeAllocator::new(device)?),
    })
}
