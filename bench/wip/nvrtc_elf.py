"""Scratch: the SASS of a cubin, as bytes per .text.<function> section (no cuobjdump here)."""
import struct


def text_sections(cubin):
    """{section name: bytes} of the ELF's .text.* sections (the SASS of each function)."""
    b = cubin
    assert b[:4] == b"\x7fELF" and b[4] == 2, "not ELF64"
    shoff, = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", b, 0x3A)
    secs = []
    for i in range(shnum):
        name, typ, flags, addr, off, size = struct.unpack_from("<IIQQQQ", b, shoff + i * shentsize)
        secs.append((name, off, size))
    stro = secs[shstrndx][1]

    def nm(o):
        e = b.index(b"\0", stro + o)
        return b[stro + o:e].decode()
    return {nm(n): b[o:o + s] for n, o, s in secs if nm(n).startswith(".text.")}


def sass_summary(cubin):
    t = text_sections(cubin)
    return {k: len(v) // 16 for k, v in t.items()}


def same_sass(a, b):
    return text_sections(a) == text_sections(b)
