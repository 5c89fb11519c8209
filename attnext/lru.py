"""Bounded in-memory caches: LRU (thread-safe, least recently used first out) and CountedCache
(an LRU of things made from a key, with the counters cache_info() reports). The tracer, the
interpreter's programs, the generated CUDA sources and the GPU host side's plans use them."""
import collections
import threading
import time


class LRU:
    """A thread-safe mapping bounded to `capacity` entries; the least recently used goes first.

    get() and put() both count as a use. on_evict(key, value), if given, is called for each
    entry pushed out by put() (outside the lock), e.g. to unload a CUDA module.
    """

    def __init__(self, capacity, on_evict=None):
        if int(capacity) < 1:
            raise ValueError(f"LRU capacity must be at least 1, got {capacity!r}")
        self.capacity = int(capacity)
        self._on_evict = on_evict
        self._data = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, default=None):
        with self._lock:
            try:
                self._data.move_to_end(key)
            except KeyError:
                return default
            return self._data[key]

    def put(self, key, value):
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            evicted = []
            while len(self._data) > self.capacity:
                evicted.append(self._data.popitem(last=False))
        if self._on_evict is not None:
            for k, v in evicted:
                self._on_evict(k, v)

    def pop(self, key, default=None):
        with self._lock:
            return self._data.pop(key, default)

    def clear(self):
        with self._lock:
            self._data.clear()

    def keys(self):
        """The keys, least recently used first (a snapshot)."""
        with self._lock:
            return list(self._data)

    def __contains__(self, key):
        with self._lock:
            return key in self._data

    def __len__(self):
        with self._lock:
            return len(self._data)

    def __repr__(self):
        return f"LRU({len(self)}/{self.capacity} entries)"


class CountedCache:
    """An LRU of things made from a key (lowered programs, generated code), counting hits,
    misses, makes ("compiles") and the seconds making took, for cache_info()."""

    def __init__(self, capacity):
        self._lru = LRU(capacity)
        self._lock = threading.Lock()
        self._stats = dict(hits=0, misses=0, compiles=0, compile_seconds=0.0)

    def get_or_make(self, key, make):
        hit = self._lru.get(key)
        if hit is not None:
            with self._lock:
                self._stats["hits"] += 1
            return hit
        t0 = time.perf_counter()
        value = make()
        seconds = time.perf_counter() - t0
        self._lru.put(key, value)
        with self._lock:
            self._stats["misses"] += 1
            self._stats["compiles"] += 1
            self._stats["compile_seconds"] += seconds
        return value

    def info(self):
        """hits, misses, compiles, compile_seconds, entries, capacity."""
        with self._lock:
            out = dict(self._stats)
        out.update(entries=len(self._lru), capacity=self._lru.capacity)
        return out

    def clear(self):
        """Forgets every entry (the counters are kept)."""
        self._lru.clear()
