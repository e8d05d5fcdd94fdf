// RecordInput: TFRecord files -> shuffled batches of serialized records,
// read by background threads. The idea of TensorFlow's RecordInput op
// (tensorflow/core/kernels/record_yielder.h): several reader threads, one
// large shuffle pool, output once the pool is half full.
//
// Pure C++17 (+ zlib through record_io), so it runs under TSan and ASan.
//
// Pipeline
// --------
//   files (matched, sharded by file)
//     -> R reader threads, R = min(parallelism, files); each epoch the file
//        list is shuffled by (seed, epoch), rotated by shift_ratio * files,
//        and file j goes to reader j % R. Each reader sends its records, in
//        chunks, through its own bounded queue. A record stays where the
//        reader read it, in a block of its file (RecordBlock): a chunk is
//        the block (shared) and where its records lie.
//     -> one mixer thread takes records from the readers in strict
//        round-robin order (record by record; a reader that finished the
//        epoch is skipped until every reader has), keeps a pool of at most
//        buffer_size records, and starts emitting once the pool holds
//        ceil(buffer_size / 2). While the pool is below full it takes two
//        records per record emitted, so it fills up. Each record emitted is
//        drawn uniformly from the pool by a generator seeded with `seed`.
//     -> batches of batch_size records (one flat byte buffer + offsets)
//        in a bounded output queue of `prefetch_batches`.
//
// Copies and memory: a record's bytes are copied once on the way, from its
// block into its batch (the pool holds where records lie, not their bytes;
// the reads themselves are read(2) into the blocks). A block is freed when
// the last of its records leaves the pool, which, with records drawn at
// random, takes several times as long as the average record stays: to hold
// the blocks to about twice the bytes of the pool's records (plus 8 blocks),
// the mixer moves the few records left in its emptiest block into a block of
// its own and frees that one ("compaction"; ~0.1-0.3 copies per record).
//
// Determinism
// -----------
// Every decision of the mixer depends only on the data and the seed, never
// on thread timing (it waits for the reader whose turn it is rather than
// taking whichever is ready), so a fixed seed gives the same batches, in
// the same order, every run, whatever `parallelism` threads do. The price:
// a slow reader holds the others back by at most its queue's depth.
// (TensorFlow's RecordYielder adds records in arrival order and is not
// deterministic with parallelism > 1; the issue asks for determinism.)
//
// Epochs: epochs < 0 repeats forever (TensorFlow's behaviour); otherwise
// after `epochs` passes the pool drains and the last batch may be short,
// then take() reports kClosed. Records of epoch e+1 join the pool while
// records of epoch e are still in it, as in TensorFlow.
//
// A pass that yields no record (every file empty, unreadable, deleted, or
// failing before its first complete record) ends the data: the next pass
// would read the same files and find nothing again, so repeating it could
// only spin (or repeat the same errors without end). After that pass's
// errors and the records still in the pool:
//   - epochs >= 1: kClosed, a clean end, as for an empty finite dataset;
//   - epochs < 0: a RecordError kNoRecords naming the files, then kClosed.
//     "Forever" over files without a record can never give an item, so
//     ending quietly would hide the mistake and spinning would hang.
//
// Errors
// ------
// A reader that hits a bad file (truncated, bad CRC, unreadable) sends the
// error at its position and goes on with its next file (the rest of a bad
// file cannot be resynced). The mixer puts the error in the output queue
// where the round-robin reaches it; take() rethrows it. A consumer may stop
// there (close()) or take again to continue past it, which is what a stage's
// ignored_exception_types needs (skip and count).
//
// Threads and lifetime
// --------------------
// The constructor validates everything and matches the files; it starts no
// thread (bad input fails at once, before any thread exists). The threads
// start on the first take() (or start()). take()/try_take_until() may be
// called from any number of threads at once; each batch goes to exactly one
// caller. close() may be called from any thread, at any time, also while
// others are blocked in take(): it wakes them (kCancelled), stops and joins
// every thread, and is idempotent. The destructor calls close(); it must
// not run while another thread is inside a method (hold it by shared_ptr).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "records/record_io.h"
#include "staging/bounded_buffer.h"

namespace torch_stage::records {

struct RecordInputOptions {
  std::vector<std::string> file_patterns;
  int64_t parallelism = 16; // >= 1 reader threads (fewer if fewer files)
  int64_t buffer_size = 10000; // >= 1 records in the shuffle pool
  int64_t batch_size = 32; // >= 1 records per batch
  std::optional<uint64_t> seed = 301; // nullopt: a random seed
  double shift_ratio = 0.0; // in [0, 1)
  Compression compression = Compression::kNone;
  int64_t shard_rank = 0;
  int64_t shard_world = 1;
  int64_t epochs = -1; // < 0: forever; else >= 1
  int64_t prefetch_batches = 2; // >= 1 finished batches waiting
  // >= 1 records per reader->mixer hand-off (at most 256 KiB of them): a
  // hand-off may wake a thread (a few microseconds of a core), so hundreds
  // of small records share one.
  int64_t chunk_records = 512;
  int64_t reader_queue_chunks = 4; // >= 1 chunks queued per reader
};

// A batch of serialized records: record i is
// data[offsets[i] : offsets[i + 1]]; offsets has size() + 1 entries.
struct RecordBatch {
  std::vector<uint8_t> data;
  std::vector<int64_t> offsets{0};

  size_t size() const {
    return offsets.size() - 1;
  }
};

struct RecordInputStats {
  int64_t files = 0; // files in this shard
  int64_t readers = 0; // reader threads
  int64_t records_read = 0; // by the readers
  int64_t records_out = 0; // placed into batches
  int64_t batches_out = 0; // handed to the output queue
  int64_t errors = 0; // reader errors passed on
  int64_t pool_size = 0; // records in the shuffle pool now
  int64_t epoch = 0; // the epoch the mixer is taking records from
  // Bytes of the file blocks the pool's records lie in (the records and the
  // rest of their blocks), as of the last batch.
  int64_t buffer_bytes = 0;
  // Records compaction moved out of an emptied block (see Copies above).
  int64_t records_compacted = 0;
  bool started = false;
  bool closed = false;
};

class RecordInput {
 public:
  using Clock = std::chrono::steady_clock;

  // Validates (RecordError kInvalidArgument naming the value and the
  // rule), matches and shards the files (kNotFound when nothing matches).
  explicit RecordInput(RecordInputOptions options);
  ~RecordInput();
  RecordInput(const RecordInput&) = delete;
  RecordInput& operator=(const RecordInput&) = delete;

  // The files of this shard, sorted.
  const std::vector<std::string>& files() const {
    return files_;
  }
  const RecordInputOptions& options() const {
    return options_;
  }

  // Starts the threads if they are not running. Idempotent; no-op after
  // close(). Any thread.
  void start();

  // Blocks for the next batch. kOk: *out holds it. kClosed: every epoch was
  // delivered (end of data). kCancelled: close() was called. Rethrows a
  // reader's RecordError when that is the next item (see Errors above).
  BufferStatus take(RecordBatch* out);
  // As take(), but kTimeout once `deadline` passes.
  BufferStatus try_take_until(RecordBatch* out, Clock::time_point deadline);

  // Stops and joins every thread; wakes waiting takers. Idempotent. Any
  // thread but this object's own.
  void close();

  RecordInputStats stats() const;

 private:
  struct Chunk {
    // Records of one block of a file, where the reader read them.
    std::shared_ptr<RecordBlock> block;
    std::vector<RecordSpan> records;
    std::exception_ptr error; // a chunk is records, or an error, or
    bool end_of_epoch = false; // the end of the reader's epoch
    // The error is not a data error (e.g. out of memory): the reader has
    // stopped, so the pipeline cannot go on.
    bool fatal = false;
  };
  struct Item {
    RecordBatch batch;
    std::exception_ptr error;
  };
  using ChunkQueue = BoundedBuffer<Chunk>;
  using OutputQueue = BoundedBuffer<Item>;
  // kBarren: a whole pass yielded no record, with epochs < 0 (see Epochs).
  enum class Pull { kRecord, kError, kFatal, kExhausted, kBarren, kStopped };

  BufferStatus finish_take(BufferStatus status, Item& item, RecordBatch* out);
  std::vector<std::string> epoch_order(int64_t epoch) const;
  void reader_main(size_t reader);
  void mixer_main();
  std::exception_ptr no_records_error() const;
  // A record and the slot of held_ whose block it lies in.
  struct PoolRecord {
    const uint8_t* data = nullptr;
    size_t size = 0;
    uint32_t slot = 0;
  };
  Pull pull(PoolRecord* record, std::exception_ptr* error);
  // The slot holding `block`: `hint` if it already does, else a new one.
  // Either way one more reference (live) is counted.
  uint32_t hold(const std::shared_ptr<RecordBlock>& block, uint32_t hint);
  // One reference fewer; the block is freed with the last one.
  void release(uint32_t slot);

  const RecordInputOptions options_;
  std::vector<std::string> files_;
  size_t readers_ = 0;
  uint64_t seed_ = 0;

  // One queue per reader (reader k -> mixer) and the output queue: their
  // own locks make them safe from any thread.
  std::vector<std::unique_ptr<ChunkQueue>> queues_;
  OutputQueue output_;

  std::atomic<bool> stop_{false};

  // Guards starting and joining (threads_, started_, closed_).
  mutable std::mutex lifecycle_mu_;
  std::vector<std::thread> threads_;
  bool started_ = false;
  bool closed_ = false;

  // Mixer state: touched only by the mixer thread.
  static constexpr uint32_t kNoSlot = ~uint32_t{0};
  struct Cursor {
    Chunk chunk;
    size_t next = 0;
    // The slot of chunk.block while the chunk has records to give: the
    // cursor holds one reference to it, so it outlives the chunk's records
    // the pool has drawn already.
    uint32_t slot = kNoSlot;
  };
  // Blocks that records in the pool (or a cursor) lie in, with how many.
  struct HeldBlock {
    std::shared_ptr<RecordBlock> block;
    size_t live = 0;
  };
  std::vector<HeldBlock> held_;
  std::vector<uint32_t> free_slots_;
  size_t held_bytes_ = 0; // capacity of the blocks in held_
  std::vector<Cursor> cursors_;
  std::vector<bool> epoch_done_;
  size_t active_ = 0; // readers not yet done with epoch_
  size_t turn_ = 0; // the reader whose record comes next
  int64_t epoch_records_ = 0; // records pulled in epoch_

  // Counters for stats(): written by the worker threads, read by anyone;
  // updated per chunk (records_read_) and per batch (records_out_), not per
  // record. The readers' counter has a cache line of its own, away from the
  // mixer's.
  alignas(64) std::atomic<int64_t> records_read_{0};
  alignas(64) std::atomic<int64_t> records_out_{0};
  std::atomic<int64_t> batches_out_{0};
  std::atomic<int64_t> errors_{0};
  std::atomic<int64_t> pool_size_{0};
  std::atomic<int64_t> epoch_{0};
  std::atomic<int64_t> buffer_bytes_{0};
  std::atomic<int64_t> records_compacted_{0};
};

} // namespace torch_stage::records
