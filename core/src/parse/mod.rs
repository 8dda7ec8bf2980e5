//! Parsers for raw input: `/dev/kmsg` records, kernel messages (Xid, SXid, fallen off the bus,
//! PCIe AER, machine checks), PCI addresses, and the Ascend tools' output (`npu-smi`,
//! `hccn_tool`).
//!
//! Parsers work on borrowed text, allocate only for what they return, and never panic: any
//! input either yields an event or `None`. Each has a fuzz-style property test.

pub mod ascend;
pub mod kernel;
pub mod kmsg;
pub mod pci;

pub use kernel::{parse_message, KernelEvent};
pub use kmsg::{parse_record, KmsgRecord, RecordError};
pub use pci::PciAddr;
