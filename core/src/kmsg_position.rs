//! Where the kernel-log reader is in its log: the cursor the engine saves with its state and
//! a restart resumes after. A leaf: the reader (`kmsg_reader`) moves it, the engine keeps it.

/// Where the reader is in the log, saved with the engine so that a restart resumes after it:
/// every record up to sequence number `seq`, and the first `unsequenced` records after that one
/// that carry no usable sequence number (a malformed header, a dmesg-format line, a number that
/// cannot be right). Without `seq`: the first `unsequenced` records of the log.
///
/// A record without a usable number can be told from the others only by its place, so its
/// place is counted from the last record that had one. Within a log, a later record is always at
/// a greater `(seq, unsequenced)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KmsgPosition {
    pub seq: Option<u64>,
    pub unsequenced: u64,
    /// Which log the position is in, as its reader names it (the agent: the file's device and
    /// inode in file mode; none for `/dev/kmsg`). A position in another log resumes nothing.
    pub log: Option<u64>,
    /// In a regular file: the bytes read up to here ([`crate::kmsg_reader::KmsgReader::read_to`]). A file that no
    /// longer starts with them (rewritten in place, or a new file with the old inode number)
    /// is another log. `None`: not a regular file, or not known (a loss report's cut before the
    /// first line, a state saved before this existed).
    pub read: Option<Extent>,
}

/// The start of a regular file read so far: how many bytes, and a hash of them (the agent's:
/// the first 8 bytes of their SHA-256).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Extent {
    pub bytes: u64,
    pub hash: u64,
}

impl KmsgPosition {
    /// Just after the record numbered `seq`.
    pub fn at_seq(seq: u64) -> Self {
        KmsgPosition {
            seq: Some(seq),
            ..Default::default()
        }
    }

    /// The place in its log, in log order.
    pub(crate) fn place(&self) -> (Option<u64>, u64) {
        (self.seq, self.unsequenced)
    }

    /// Nothing read yet.
    pub fn is_start(&self) -> bool {
        self.seq.is_none() && self.unsequenced == 0
    }
}
