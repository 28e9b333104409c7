//! Input files are checked to be regular files before they are opened:
//! opening a FIFO blocks until a writer comes, and a device never ends.

use std::path::Path;

use crate::CaptureError;

/// What `path` is when it is not a regular file ("a directory", "a FIFO
/// (named pipe)", ...), following symlinks; None for a regular file.
pub(crate) fn non_regular(path: &Path) -> Result<Option<&'static str>, CaptureError> {
    let meta = std::fs::metadata(path).map_err(|e| CaptureError::io(path, e))?;
    if meta.is_file() {
        return Ok(None);
    }
    let t = meta.file_type();
    if t.is_dir() {
        return Ok(Some("a directory"));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return Ok(Some("a FIFO (named pipe)"));
        }
        if t.is_char_device() {
            return Ok(Some("a character device"));
        }
        if t.is_block_device() {
            return Ok(Some("a block device"));
        }
        if t.is_socket() {
            return Ok(Some("a socket"));
        }
    }
    Ok(Some("a special file"))
}

/// The text of `path`, refused unless it is a regular file; `what` names
/// it in errors ("prompt file").
pub fn read_text_file(path: &Path, what: &'static str) -> Result<String, CaptureError> {
    if let Some(kind) = non_regular(path)? {
        return Err(CaptureError::NotAFile {
            path: path.into(),
            what,
            kind,
        });
    }
    std::fs::read_to_string(path).map_err(|e| CaptureError::io(path, e))
}
