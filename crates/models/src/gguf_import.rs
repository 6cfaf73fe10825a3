//! GGUF import (in progress).
