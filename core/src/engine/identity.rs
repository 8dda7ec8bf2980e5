//! Device identity: how a signal's device reference (PCI address, UUID, index, name) becomes
//! one fault key and one display name, and how faults follow a device when the engine learns
//! its UUID or index later.

use super::{DeviceRef, Engine};
use crate::catalog::FaultCode;
use crate::parse::PciAddr;

impl Engine {
    pub(super) fn device_seen(&mut self, pci: PciAddr, uuid: Option<String>, index: Option<u32>) {
        // Bounded: a device past the limit is not remembered (its faults keep its PCI address).
        if self.devices.len() >= super::MAX_DEVICES && !self.devices.contains_key(&pci) {
            return;
        }
        let info = self.devices.entry(pci).or_default();
        let mut changed = false;
        if uuid.is_some() && info.uuid != uuid {
            info.uuid = uuid;
            changed = true;
        }
        if index.is_some() && info.index != index {
            info.index = index;
            changed = true;
        }
        if !changed {
            return;
        }
        let info = info.clone();
        let pci_s = pci.to_string();
        for f in self.faults.values_mut() {
            if f.fault.pci_bus_id.as_deref() == Some(pci_s.as_str()) {
                f.fault.device_uuid = info.uuid.clone();
                if let Some(i) = info.index {
                    f.fault.device = format!("GPU-{i}");
                }
            }
        }
        self.revision += 1;
    }
    /// Key and display fields for a device reference, using what the engine knows.
    pub(super) fn resolve_device(
        &self,
        d: Option<&DeviceRef>,
    ) -> (String, String, Option<String>, Option<String>) {
        let Some(d) = d else {
            return ("node".into(), "node".into(), None, None);
        };
        // Only an index (a GPU whose identity could not be read, for one lost at a restart): the
        // PCI address the engine knows for that index, when exactly one device has it, so the
        // fault gets the key it had before (saved faults are keyed by PCI address).
        let by_index = match (d.pci, &d.uuid, &d.name, d.index) {
            (None, None, None, Some(i)) => {
                let mut with = self
                    .devices
                    .iter()
                    .filter(|(_, k)| k.index == Some(i))
                    .map(|(p, _)| *p);
                match (with.next(), with.next()) {
                    (Some(p), None) => Some(p),
                    _ => None,
                }
            }
            _ => None,
        };
        let pci_addr = d.pci.or(by_index);
        let known = pci_addr.and_then(|p| self.devices.get(&p));
        let uuid = d
            .uuid
            .clone()
            .or_else(|| known.and_then(|k| k.uuid.clone()));
        let index = d.index.or_else(|| known.and_then(|k| k.index));
        let pci = pci_addr.map(|p| p.to_string());
        let key = pci
            .clone()
            .or_else(|| uuid.clone())
            .or_else(|| d.name.clone())
            .or_else(|| index.map(|i| format!("GPU-{i}")))
            .unwrap_or_else(|| "node".into());
        let name = d
            .name
            .clone()
            .or_else(|| index.map(|i| format!("GPU-{i}")))
            .or_else(|| pci.as_ref().map(|p| format!("GPU-{p}")))
            .or_else(|| uuid.clone())
            .unwrap_or_else(|| "node".into());
        (key, name, uuid, pci)
    }
    pub(super) fn fault_key(&self, code: &FaultCode, device: Option<&DeviceRef>) -> String {
        format!("{}/{}", code, self.resolve_device(device).0)
    }
}
