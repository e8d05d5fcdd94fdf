#include "records/record_input.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <utility>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace torch_stage::records {
namespace {

// Seeds derived from (seed, stream) with splitmix64, so the file order of
// each epoch and the pool's draws are independent, reproducible streams.
uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [0, n) by rejection: std::uniform_int_distribution's output is
// implementation-defined, and a fixed seed must give the same order with
// every standard library.
template <typename Rng>
uint64_t bounded(Rng& rng, uint64_t n) {
  const uint64_t limit = (0 - n) % n; // 2^64 mod n
  while (true) {
    const uint64_t r = rng();
    if (r >= limit) {
      return r % n;
    }
  }
}

// The generator's values, kAhead of them known in advance: the mixer
// prefetches the pool entries (and then the records) that draws a few steps
// on will pick, had the pool its size now. The values, and so the draws, are
// the generator's own; a guess that turns out wrong only wasted a prefetch.
class LookaheadRng {
 public:
  static constexpr size_t kAhead = 16;
  explicit LookaheadRng(uint64_t seed) : rng_(seed) {
    for (auto& v : ahead_) {
      v = rng_();
    }
  }
  uint64_t operator()() {
    const uint64_t v = ahead_[at_];
    ahead_[at_] = rng_();
    at_ = (at_ + 1) % kAhead;
    return v;
  }
  // The value the k-th call from now returns (k < kAhead).
  uint64_t peek(size_t k) const {
    return ahead_[(at_ + k) % kAhead];
  }

 private:
  std::mt19937_64 rng_;
  uint64_t ahead_[kAhead];
  size_t at_ = 0;
};

// Compaction (see the header): the blocks it moves records into, and how
// many of them above twice the pool's record bytes (and the blocks the
// readers' cursors are in) the held blocks may go first.
constexpr size_t kCompactBlockBytes = 256 * 1024;
constexpr size_t kCompactSlackBlocks = 8;
// How many draws ahead the mixer prefetches a pool entry (and half as many,
// the record it points to).
constexpr size_t kPrefetchDraws = 8;

[[noreturn]] void invalid(const std::string& message) {
  throw RecordError(RecordErrorKind::kInvalidArgument, message);
}

void check_at_least(const char* name, int64_t value, int64_t minimum) {
  if (value < minimum) {
    invalid(
        std::string(name) + " must be >= " + std::to_string(minimum) +
        ", got " + std::to_string(value));
  }
}

// Names the calling thread (at most 15 characters on Linux), so that top,
// perf and a benchmark's per-thread CPU times tell readers from the mixer.
void name_this_thread(const std::string& name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
#else
  (void)name;
#endif
}

} // namespace

RecordInput::RecordInput(RecordInputOptions options)
    : options_(std::move(options)),
      output_(static_cast<size_t>(
          std::max<int64_t>(1, options_.prefetch_batches))) {
  check_at_least("parallelism", options_.parallelism, 1);
  check_at_least("buffer_size", options_.buffer_size, 1);
  check_at_least("batch_size", options_.batch_size, 1);
  check_at_least("prefetch_batches", options_.prefetch_batches, 1);
  check_at_least("chunk_records", options_.chunk_records, 1);
  check_at_least("reader_queue_chunks", options_.reader_queue_chunks, 1);
  if (!(options_.shift_ratio >= 0.0 && options_.shift_ratio < 1.0)) {
    invalid(
        "shift_ratio must be in [0, 1), got " +
        std::to_string(options_.shift_ratio));
  }
  if (options_.epochs == 0) {
    invalid("epochs must be >= 1, or None to repeat forever, got 0");
  }
  files_ = shard_files(
      match_files(options_.file_patterns),
      options_.shard_rank,
      options_.shard_world);
  readers_ = std::min(static_cast<size_t>(options_.parallelism), files_.size());
  if (options_.seed.has_value()) {
    seed_ = *options_.seed;
  } else {
    std::random_device device;
    seed_ = (static_cast<uint64_t>(device()) << 32) ^ device();
  }
  for (size_t k = 0; k < readers_; ++k) {
    queues_.push_back(std::make_unique<ChunkQueue>(
        static_cast<size_t>(options_.reader_queue_chunks)));
  }
  cursors_.resize(readers_);
  epoch_done_.assign(readers_, false);
  active_ = readers_;
}

RecordInput::~RecordInput() {
  close();
}

void RecordInput::start() {
  std::lock_guard<std::mutex> lock(lifecycle_mu_);
  if (started_ || closed_) {
    return;
  }
  started_ = true;
  threads_.reserve(readers_ + 1);
  for (size_t k = 0; k < readers_; ++k) {
    threads_.emplace_back([this, k] { reader_main(k); });
  }
  threads_.emplace_back([this] { mixer_main(); });
}

void RecordInput::close() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(lifecycle_mu_);
    if (closed_) {
      return;
    }
    closed_ = true;
    threads.swap(threads_);
  }
  stop_.store(true);
  // Cancel wakes every thread blocked on a queue (readers in put, the mixer
  // in take or put, consumers in take); the rest check stop_ per record.
  output_.cancel();
  for (auto& q : queues_) {
    q->cancel();
  }
  for (auto& t : threads) {
    t.join();
  }
}

BufferStatus RecordInput::finish_take(
    BufferStatus status,
    Item& item,
    RecordBatch* out) {
  if (status != BufferStatus::kOk) {
    return status;
  }
  if (item.error) {
    std::rethrow_exception(item.error);
  }
  *out = std::move(item.batch);
  return status;
}

BufferStatus RecordInput::take(RecordBatch* out) {
  start();
  Item item;
  const BufferStatus status = output_.take(item);
  return finish_take(status, item, out);
}

BufferStatus RecordInput::try_take_until(
    RecordBatch* out,
    Clock::time_point deadline) {
  start();
  Item item;
  const BufferStatus status = output_.try_take_until(item, deadline);
  return finish_take(status, item, out);
}

RecordInputStats RecordInput::stats() const {
  RecordInputStats s;
  s.files = static_cast<int64_t>(files_.size());
  s.readers = static_cast<int64_t>(readers_);
  s.records_read = records_read_.load();
  s.records_out = records_out_.load();
  s.batches_out = batches_out_.load();
  s.errors = errors_.load();
  s.pool_size = pool_size_.load();
  s.epoch = epoch_.load();
  s.buffer_bytes = buffer_bytes_.load();
  s.records_compacted = records_compacted_.load();
  std::lock_guard<std::mutex> lock(lifecycle_mu_);
  s.started = started_;
  s.closed = closed_;
  return s;
}

std::vector<std::string> RecordInput::epoch_order(int64_t epoch) const {
  std::vector<std::string> order = files_;
  std::mt19937_64 rng(
      splitmix64(seed_ ^ splitmix64(static_cast<uint64_t>(epoch) + 1)));
  for (size_t i = order.size(); i > 1; --i) { // Fisher-Yates
    std::swap(order[i - 1], order[bounded(rng, i)]);
  }
  // TensorFlow's shift: distributed workers sharing files start at
  // different places in the list.
  const auto shift = static_cast<size_t>(
      std::floor(options_.shift_ratio * static_cast<double>(order.size())));
  std::rotate(order.begin(), order.begin() + shift, order.end());
  return order;
}

void RecordInput::reader_main(size_t k) {
  name_this_thread("tsrec:read:" + std::to_string(k));
  ChunkQueue& queue = *queues_[k];
  auto send = [&](Chunk& chunk) {
    return queue.put(chunk) == BufferStatus::kOk;
  };
  std::exception_ptr fatal;
  try {
    for (int64_t epoch = 0; options_.epochs < 0 || epoch < options_.epochs;
         ++epoch) {
      const std::vector<std::string> order = epoch_order(epoch);
      for (size_t j = k; j < order.size(); j += readers_) {
        if (stop_.load()) {
          return;
        }
        Chunk chunk;
        auto send_records = [&] {
          records_read_.fetch_add(
              static_cast<int64_t>(chunk.records.size()),
              std::memory_order_relaxed);
          if (!send(chunk)) {
            return false;
          }
          chunk = Chunk{};
          return true;
        };
        std::exception_ptr error;
        try {
          RecordReader reader(order[j], options_.compression);
          RecordSpan record;
          while (!stop_.load(std::memory_order_relaxed)) {
            if (!reader.next(&record)) {
              break;
            }
            // A chunk is records of one block: the reader went on in a new
            // one, so the chunk so far goes first.
            if (chunk.block != reader.block()) {
              if (!chunk.records.empty() && !send_records()) {
                return;
              }
              chunk.block = reader.block();
              chunk.records.reserve(static_cast<size_t>(
                  std::min<int64_t>(options_.chunk_records, 4096)));
            }
            chunk.records.push_back(record);
            if (chunk.records.size() >=
                static_cast<size_t>(options_.chunk_records)) {
              if (!send_records()) {
                return;
              }
            }
          }
        } catch (const RecordError&) {
          // Sent after the handler ends (below), so that this thread holds
          // no reference to the error once it is out: the last one goes
          // with the thread that reads it. (Otherwise the handler's
          // reference, dropped inside libstdc++, could be the last and free
          // the error after a taker read it, an order TSan cannot see.)
          error = std::current_exception();
        }
        if (error) {
          // Deliver what was read before the error, then the error.
          Chunk failed;
          failed.error = std::exchange(error, nullptr);
          if ((!chunk.records.empty() && !send_records()) || !send(failed)) {
            return;
          }
          continue;
        }
        if (stop_.load()) {
          return;
        }
        if (!chunk.records.empty() && !send_records()) {
          return;
        }
      }
      Chunk end;
      end.end_of_epoch = true;
      if (!send(end)) {
        return;
      }
    }
  } catch (...) {
    // Not a data error (e.g. out of memory): hand it on; the mixer stops.
    fatal = std::current_exception();
  }
  if (fatal) {
    Chunk failed;
    failed.error = std::move(fatal);
    failed.fatal = true;
    queue.put(failed);
  }
}

uint32_t RecordInput::hold(
    const std::shared_ptr<RecordBlock>& block,
    uint32_t hint) {
  if (hint != kNoSlot && held_[hint].block == block) {
    ++held_[hint].live;
    return hint;
  }
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(held_.size());
    held_.emplace_back();
  }
  held_[slot].block = block;
  held_[slot].live = 1;
  held_bytes_ += block->capacity;
  return slot;
}

void RecordInput::release(uint32_t slot) {
  HeldBlock& h = held_[slot];
  if (--h.live == 0) {
    held_bytes_ -= h.block->capacity;
    h.block.reset();
    free_slots_.push_back(slot);
  }
}

RecordInput::Pull RecordInput::pull(
    PoolRecord* record,
    std::exception_ptr* error) {
  while (true) {
    if (active_ == 0) {
      if (epoch_records_ == 0) {
        return options_.epochs < 0 ? Pull::kBarren : Pull::kExhausted;
      }
      const int64_t next = epoch_.load(std::memory_order_relaxed) + 1;
      if (options_.epochs >= 0 && next >= options_.epochs) {
        return Pull::kExhausted;
      }
      epoch_.store(next, std::memory_order_relaxed);
      std::fill(epoch_done_.begin(), epoch_done_.end(), false);
      active_ = readers_;
      turn_ = 0;
      epoch_records_ = 0;
    }
    while (epoch_done_[turn_]) {
      turn_ = (turn_ + 1) % readers_;
    }
    const size_t r = turn_;
    Cursor& cur = cursors_[r];
    if (cur.next >= cur.chunk.records.size()) {
      Chunk chunk;
      const BufferStatus status = queues_[r]->take(chunk);
      if (status != BufferStatus::kOk) {
        return Pull::kStopped;
      }
      // Hold the new chunk's block before letting go of the last one's,
      // which is often the same block.
      const uint32_t previous = cur.slot;
      cur.slot = chunk.records.empty() ? kNoSlot : hold(chunk.block, previous);
      if (previous != kNoSlot) {
        release(previous);
      }
      cur.chunk = std::move(chunk);
      cur.next = 0;
      if (cur.chunk.error) {
        *error = std::move(cur.chunk.error);
        const bool fatal = cur.chunk.fatal;
        cur.chunk = Chunk{};
        turn_ = (r + 1) % readers_;
        return fatal ? Pull::kFatal : Pull::kError;
      }
      if (cur.chunk.end_of_epoch) {
        epoch_done_[r] = true;
        --active_;
        cur.chunk = Chunk{};
        turn_ = (r + 1) % readers_;
        continue;
      }
      if (cur.chunk.records.empty()) {
        continue;
      }
    }
    const RecordSpan& span = cur.chunk.records[cur.next];
    record->data = span.data;
    record->size = span.size;
    record->slot = cur.slot;
    ++held_[cur.slot].live;
    ++cur.next;
    ++epoch_records_;
    turn_ = (r + 1) % readers_;
    return Pull::kRecord;
  }
}

std::exception_ptr RecordInput::no_records_error() const {
  // Name every file, up to a bound that keeps the message readable.
  constexpr size_t kNamed = 8;
  std::string names;
  for (size_t i = 0; i < files_.size() && i < kNamed; ++i) {
    names += (i == 0 ? "'" : ", '") + files_[i] + "'";
  }
  if (files_.size() > kNamed) {
    names += " and " + std::to_string(files_.size() - kNamed) + " more";
  }
  return std::make_exception_ptr(RecordError(
      RecordErrorKind::kNoRecords,
      "RecordInput read no record in a whole pass (epoch " +
          std::to_string(epoch_.load(std::memory_order_relaxed)) +
          ") over its " + std::to_string(files_.size()) + " file(s): " + names +
          ". Each is empty, unreadable, or fails before its first complete "
          "record (its error came before this one); with epochs=None the "
          "passes would repeat forever without an item. Give files that "
          "hold records, or a finite number of epochs",
      files_.size() == 1 ? files_[0] : std::string()));
}

void RecordInput::mixer_main() {
  name_this_thread("tsrec:mix");
  const size_t capacity = static_cast<size_t>(options_.buffer_size);
  const size_t threshold = (capacity + 1) / 2;
  const size_t batch_size = static_cast<size_t>(options_.batch_size);
  LookaheadRng rng(splitmix64(seed_));
  // buffer_size and batch_size are upper bounds: reserve at most a modest
  // start, so a huge one (2**40) cannot fail here, outside the try below,
  // before any record is read (std::terminate on this thread).
  constexpr size_t kReserveRecords = size_t{1} << 16;
  constexpr size_t kReserveBytes = size_t{64} << 20;
  // The pool's first `pool_size` entries are its records (where they lie);
  // a drawn record is swapped to the end.
  std::vector<PoolRecord> pool;
  pool.reserve(std::min(capacity, kReserveRecords));
  size_t pool_size = 0;
  size_t pool_bytes = 0; // of the records in the pool
  int64_t out_unreported = 0; // records out since records_out_ was updated
  bool exhausted = false;
  bool barren = false; // end with no_records_error() once the pool drains
  bool emitting = false; // set once the pool first reaches the threshold
  size_t mean_record = 256; // running estimate, to reserve batch buffers
  // Compaction's own block, which it moves records into (a slot of held_).
  uint32_t compact_slot = kNoSlot;
  size_t compact_used = 0;

  auto fresh_batch = [&] {
    Item item;
    const size_t records = std::min(batch_size, kReserveRecords);
    // An eighth over the running mean: a batch of somewhat larger records
    // would otherwise outgrow its buffer near the end and copy all of it.
    item.batch.data.reserve(
        std::min(records * (mean_record + mean_record / 8), kReserveBytes));
    item.batch.offsets.reserve(records + 1);
    return item;
  };
  Item current;
  // The record drawn last, not yet in `current` (see the draw below); it
  // still counts as a reference to its block.
  PoolRecord drawn;
  bool has_drawn = false;
  auto append = [&](const PoolRecord& rec) {
    auto& batch = current.batch;
    batch.data.insert(batch.data.end(), rec.data, rec.data + rec.size);
    batch.offsets.push_back(static_cast<int64_t>(batch.data.size()));
    mean_record = (mean_record * 7 + rec.size) / 8 + 1;
    release(rec.slot);
  };
  auto append_drawn = [&] {
    if (has_drawn) {
      append(drawn);
      has_drawn = false;
    }
  };

  // Moves the records of the held blocks with the fewest of them into
  // compaction blocks and frees those: the emptiest first, until the held
  // bytes would be down to 1.5x the pool's record bytes and the slack (so a
  // pass, which reads the whole pool, frees several blocks at once). Blocks
  // a cursor still reads from are left alone (they cannot be freed yet), as
  // is the compaction block being filled.
  std::vector<uint32_t> order;
  std::vector<char> moving;
  auto compact = [&](size_t slack) {
    append_drawn(); // its block may be one of those moved
    order.clear();
    for (uint32_t slot = 0; slot < held_.size(); ++slot) {
      bool skip = held_[slot].block == nullptr || slot == compact_slot;
      for (const Cursor& c : cursors_) {
        skip = skip || c.slot == slot;
      }
      if (!skip) {
        order.push_back(slot);
      }
    }
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return held_[a].live < held_[b].live;
    });
    moving.assign(held_.size(), 0);
    const size_t goal = pool_bytes + pool_bytes / 2 + slack;
    size_t after = held_bytes_;
    bool any = false;
    for (uint32_t slot : order) {
      if (after <= goal) {
        break;
      }
      moving[slot] = 1;
      any = true;
      after -= held_[slot].block->capacity;
    }
    if (!any) {
      return;
    }
    int64_t moved = 0;
    for (size_t k = 0; k < pool_size; ++k) {
      PoolRecord& rec = pool[k];
      if (!moving[rec.slot]) {
        continue;
      }
      if (compact_slot == kNoSlot ||
          compact_used + rec.size > held_[compact_slot].block->capacity) {
        auto block = std::make_shared<RecordBlock>();
        block->capacity = std::max(kCompactBlockBytes, rec.size);
        block->bytes.reset(new uint8_t[block->capacity]);
        const uint32_t previous = compact_slot;
        compact_slot = hold(block, kNoSlot); // the mixer's own reference
        compact_used = 0;
        if (previous != kNoSlot) {
          release(previous);
        }
        // (Its slot may be a victim's, freed a moment ago: what lands in it
        // from now on is not to be moved.)
        moving.resize(std::max(moving.size(), held_.size()), 0);
        moving[compact_slot] = 0;
      }
      uint8_t* to = held_[compact_slot].block->bytes.get() + compact_used;
      std::memcpy(to, rec.data, rec.size);
      compact_used += rec.size;
      ++held_[compact_slot].live;
      release(rec.slot);
      rec.data = to;
      rec.slot = compact_slot;
      ++moved;
    }
    records_compacted_.fetch_add(moved, std::memory_order_relaxed);
  };

  auto emit = [&](Item& item) {
    records_out_.fetch_add(
        std::exchange(out_unreported, 0), std::memory_order_relaxed);
    buffer_bytes_.store(
        static_cast<int64_t>(held_bytes_), std::memory_order_relaxed);
    if (output_.put(item) != BufferStatus::kOk) {
      return false;
    }
    return true;
  };

  std::exception_ptr fatal;
  try {
    current = fresh_batch();
    while (!stop_.load(std::memory_order_relaxed)) {
      // Fill: one record per turn until the threshold is first reached
      // (nothing is emitted before), then two per record emitted, so the
      // pool keeps growing to full while batches flow; at most to full.
      size_t pulls = 0;
      if (!exhausted && pool_size < capacity) {
        pulls = emitting ? 2 : 1;
      }
      for (size_t p = 0; p < pulls && pool_size < capacity; ++p) {
        PoolRecord record;
        std::exception_ptr error;
        const Pull got = pull(&record, &error);
        if (got == Pull::kStopped) {
          return;
        }
        if (got == Pull::kExhausted || got == Pull::kBarren) {
          exhausted = true;
          barren = got == Pull::kBarren;
          break;
        }
        if (got == Pull::kError || got == Pull::kFatal) {
          errors_.fetch_add(1, std::memory_order_relaxed);
          Item failed;
          failed.error = std::move(error);
          if (!emit(failed)) {
            return;
          }
          if (got == Pull::kFatal) {
            output_.close();
            return;
          }
          continue;
        }
        if (pool_size == pool.size()) {
          pool.emplace_back();
        }
        pool[pool_size++] = record;
        pool_bytes += record.size;
      }
      pool_size_.store(
          static_cast<int64_t>(pool_size), std::memory_order_relaxed);
      // The slack: the blocks cursors read from, and a few more.
      const size_t slack =
          (readers_ + kCompactSlackBlocks) * kCompactBlockBytes;
      if (held_bytes_ > 2 * pool_bytes + slack) {
        compact(slack);
      }

      if (pool_size == 0 && exhausted) {
        append_drawn();
        if (current.batch.size() > 0) {
          batches_out_.fetch_add(1, std::memory_order_relaxed);
          if (!emit(current)) {
            return;
          }
        }
        if (barren) {
          errors_.fetch_add(1, std::memory_order_relaxed);
          Item failed;
          failed.error = no_records_error();
          if (!emit(failed)) {
            return;
          }
        }
        output_.close(); // end of data: takers drain, then see kClosed
        return;
      }
      if (pool_size >= threshold) {
        emitting = true;
      }
      if (pool_size == 0 || !(emitting || exhausted)) {
        continue;
      }
      // Emit one record drawn uniformly from the pool: swapped to the end,
      // out of the pool. A draw is a cache miss in a pool larger than the
      // cache, so a record that does not end its batch is only prefetched
      // now and copied into the batch at the next draw (same order, same
      // batches), its miss hidden behind the pulls between.
      // A draw several steps on (one value each, if none is rejected, which
      // happens with probability pool_size / 2^64) picks about this entry:
      // its descriptor now, its bytes a few draws later, when the
      // descriptor is in the cache.
      {
        const size_t soon = rng.peek(kPrefetchDraws) % pool_size;
        const PoolRecord& next = pool[rng.peek(kPrefetchDraws / 2) % pool_size];
        __builtin_prefetch(&pool[soon]);
        for (size_t at = 0; at < next.size && at < 512; at += 64) {
          __builtin_prefetch(next.data + at);
        }
      }
      const size_t j = static_cast<size_t>(bounded(rng, pool_size));
      std::swap(pool[j], pool[--pool_size]);
      const PoolRecord rec = pool[pool_size];
      pool_bytes -= rec.size;
      ++out_unreported;
      auto& batch = current.batch;
      append_drawn();
      if (batch.size() + 1 < batch_size) {
        drawn = rec;
        has_drawn = true;
        continue;
      }
      append(rec);
      if (batch.size() == batch_size) {
        batches_out_.fetch_add(1, std::memory_order_relaxed);
        if (!emit(current)) {
          return;
        }
        current = fresh_batch();
      }
    }
  } catch (...) {
    fatal = std::current_exception(); // handed on after the handler (above)
  }
  if (fatal) {
    Item failed;
    failed.error = std::move(fatal);
    emit(failed);
    output_.close();
  }
}

} // namespace torch_stage::records
