#include "mmu/state_store.h"

#include <sqlite3.h>

#include <span>
#include <utility>

namespace netdam::mmu {

namespace {

const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS devices(
  id INTEGER PRIMARY KEY, address TEXT UNIQUE NOT NULL, boot INTEGER NOT NULL, capacity INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS allocations(
  id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, size INTEGER NOT NULL, stripe INTEGER NOT NULL,
  slots INTEGER NOT NULL, copies INTEGER NOT NULL, policy INTEGER NOT NULL, key INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS extents(
  alloc_id INTEGER NOT NULL, slot INTEGER NOT NULL, device_id INTEGER NOT NULL, base INTEGER NOT NULL,
  length INTEGER NOT NULL, boot INTEGER NOT NULL, key INTEGER NOT NULL, state INTEGER NOT NULL,
  PRIMARY KEY(alloc_id, slot));
CREATE TABLE IF NOT EXISTS answered(
  requester INTEGER NOT NULL, txn INTEGER NOT NULL, opcode INTEGER NOT NULL, status INTEGER NOT NULL,
  payload BLOB NOT NULL, PRIMARY KEY(requester, txn));
CREATE TABLE IF NOT EXISTS opt_configs(alloc_id INTEGER PRIMARY KEY, config BLOB NOT NULL);
)sql";

// A prepared statement, finalized on scope exit. SQLite integers are
// signed 64-bit: u64 values are stored as their two's complement bit pattern.
class Stmt {
 public:
  Stmt(sqlite3* db, const char* sql) { ok_ = sqlite3_prepare_v2(db, sql, -1, &s_, nullptr) == SQLITE_OK; }
  ~Stmt() { sqlite3_finalize(s_); }
  Stmt(const Stmt&) = delete;
  Stmt& operator=(const Stmt&) = delete;
  bool ok() const { return ok_; }
  Stmt& bind(int i, uint64_t v) {
    ok_ = ok_ && sqlite3_bind_int64(s_, i, static_cast<sqlite3_int64>(v)) == SQLITE_OK;
    return *this;
  }
  Stmt& bind(int i, std::span<const std::byte> v) {  // empty: a zero-length blob, not NULL
    ok_ = ok_ && (v.empty() ? sqlite3_bind_zeroblob(s_, i, 0)
                            : sqlite3_bind_blob(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT)) ==
                     SQLITE_OK;
    return *this;
  }
  Stmt& bind(int i, const std::string& v) {
    ok_ = ok_ && sqlite3_bind_text(s_, i, v.data(), static_cast<int>(v.size()), SQLITE_TRANSIENT) == SQLITE_OK;
    return *this;
  }
  // SQLITE_ROW, SQLITE_DONE or an error code.
  int step() { return ok_ ? sqlite3_step(s_) : SQLITE_ERROR; }
  bool run() { return step() == SQLITE_DONE; }
  uint64_t u64(int col) const { return static_cast<uint64_t>(sqlite3_column_int64(s_, col)); }
  std::vector<std::byte> blob(int col) const {
    const auto* p = static_cast<const std::byte*>(sqlite3_column_blob(s_, col));
    return p ? std::vector<std::byte>(p, p + sqlite3_column_bytes(s_, col)) : std::vector<std::byte>();
  }
  std::string text(int col) const {
    const auto* p = sqlite3_column_text(s_, col);
    return p ? std::string(reinterpret_cast<const char*>(p)) : std::string();
  }

 private:
  sqlite3_stmt* s_ = nullptr;
  bool ok_ = false;
};

}  // namespace

Result<std::unique_ptr<StateStore>> StateStore::open(const std::string& path) {
  sqlite3* db = nullptr;
  if (sqlite3_open_v2(path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE, nullptr) != SQLITE_OK) {
    Error e = Error::transport("cannot open state file " + path + ": " + (db ? sqlite3_errmsg(db) : "out of memory"));
    sqlite3_close(db);
    return e;
  }
  std::unique_ptr<StateStore> s(new StateStore(db));
  sqlite3_busy_timeout(db, 2000);
  // WAL: a commit is one sequential append; FULL: it is on disk when the
  // proxy answers, so an acknowledged POOL_ALLOC survives a crash.
  if (!s->exec("PRAGMA journal_mode=WAL") || !s->exec("PRAGMA synchronous=FULL") || !s->exec(kSchema))
    return Error::transport("state file " + path + ": " + s->error_);
  return s;
}

StateStore::~StateStore() { sqlite3_close(db_); }

bool StateStore::exec(const char* sql) {
  char* msg = nullptr;
  if (sqlite3_exec(db_, sql, nullptr, nullptr, &msg) == SQLITE_OK) return true;
  error_ = msg ? msg : sqlite3_errmsg(db_);
  sqlite3_free(msg);
  return false;
}

Error StateStore::rollback() {
  const std::string why = error_.empty() ? sqlite3_errmsg(db_) : error_;
  exec("ROLLBACK");
  error_ = why;
  return failed();
}

Result<StoredState> StateStore::load() {
  StoredState st;
  {
    Stmt q(db_, "SELECT k, v FROM meta");
    int rc;
    while ((rc = q.step()) == SQLITE_ROW) st.meta[q.text(0)] = q.u64(1);
    if (rc != SQLITE_DONE) goto fail;
  }
  {
    Stmt q(db_, "SELECT id, address, boot, capacity FROM devices ORDER BY id");
    int rc;
    while ((rc = q.step()) == SQLITE_ROW)
      st.devices.push_back(DeviceRow{static_cast<uint32_t>(q.u64(0)), q.text(1), static_cast<uint32_t>(q.u64(2)), q.u64(3)});
    if (rc != SQLITE_DONE) goto fail;
  }
  {
    Stmt q(db_, "SELECT id, name, size, stripe, slots, copies, policy, key FROM allocations ORDER BY id");
    int rc;
    while ((rc = q.step()) == SQLITE_ROW) {
      AllocationRow a;
      a.id = q.u64(0);
      a.name = q.text(1);
      a.size = q.u64(2);
      a.stripe = static_cast<uint32_t>(q.u64(3));
      a.slots = static_cast<uint32_t>(q.u64(4));
      a.copies = static_cast<uint32_t>(q.u64(5));
      a.policy = static_cast<uint8_t>(q.u64(6));
      a.key = q.u64(7);
      st.allocations.push_back(std::move(a));
    }
    if (rc != SQLITE_DONE) goto fail;
  }
  {
    Stmt q(db_, "SELECT alloc_id, slot, device_id, base, length, boot, key, state FROM extents ORDER BY alloc_id, slot");
    int rc;
    while ((rc = q.step()) == SQLITE_ROW) {
      ExtentRow e;
      e.alloc_id = q.u64(0);
      e.slot = static_cast<uint32_t>(q.u64(1));
      e.device_id = static_cast<uint32_t>(q.u64(2));
      e.base = q.u64(3);
      e.length = q.u64(4);
      e.boot = static_cast<uint32_t>(q.u64(5));
      e.key = static_cast<uint32_t>(q.u64(6));
      e.state = static_cast<ExtentState>(q.u64(7));
      st.extents.push_back(e);
    }
    if (rc != SQLITE_DONE) goto fail;
  }
  {
    Stmt q(db_, "SELECT requester, txn, opcode, status, payload FROM answered ORDER BY rowid");
    int rc;
    while ((rc = q.step()) == SQLITE_ROW)
      st.answered.push_back(AnsweredRequest{q.u64(0), q.u64(1), static_cast<uint8_t>(q.u64(2)),
                                            static_cast<uint8_t>(q.u64(3)), q.blob(4)});
    if (rc != SQLITE_DONE) goto fail;
  }
  {
    Stmt q(db_, "SELECT alloc_id, config FROM opt_configs");
    int rc;
    while ((rc = q.step()) == SQLITE_ROW) st.opt_configs[q.u64(0)] = q.blob(1);
    if (rc != SQLITE_DONE) goto fail;
  }
  return st;
fail:
  return Error::transport(std::string("reading the state file: ") + sqlite3_errmsg(db_));
}

bool StateStore::set_meta_row(const std::string& key, uint64_t value) {
  Stmt q(db_, "INSERT INTO meta(k, v) VALUES(?, ?) ON CONFLICT(k) DO UPDATE SET v = excluded.v");
  if (q.bind(1, key).bind(2, value).run()) return true;
  error_ = sqlite3_errmsg(db_);
  return false;
}

Error StateStore::set_meta(const std::string& key, uint64_t value) {
  return set_meta_row(key, value) ? Error::ok() : failed();
}

Error StateStore::put_device(const DeviceRow& d) {
  Stmt q(db_,
         "INSERT INTO devices(id, address, boot, capacity) VALUES(?, ?, ?, ?) "
         "ON CONFLICT(id) DO UPDATE SET address = excluded.address, boot = excluded.boot, capacity = excluded.capacity");
  if (q.bind(1, d.id).bind(2, d.address).bind(3, d.boot).bind(4, d.capacity).run()) return Error::ok();
  return Error::transport(sqlite3_errmsg(db_));
}

namespace {
bool insert_extent(sqlite3* db, const ExtentRow& e) {
  Stmt q(db,
         "INSERT OR REPLACE INTO extents(alloc_id, slot, device_id, base, length, boot, key, state) "
         "VALUES(?, ?, ?, ?, ?, ?, ?, ?)");
  return q.bind(1, e.alloc_id).bind(2, e.slot).bind(3, e.device_id).bind(4, e.base).bind(5, e.length)
      .bind(6, e.boot).bind(7, e.key).bind(8, static_cast<uint64_t>(e.state)).run();
}
}  // namespace

// Inside a transaction: the answer, and the oldest beyond the bounds gone.
bool StateStore::insert_answered(const AnsweredRequest& r) {
  Stmt ins(db_, "INSERT OR REPLACE INTO answered(requester, txn, opcode, status, payload) VALUES(?, ?, ?, ?, ?)");
  Stmt mine(db_,
            "DELETE FROM answered WHERE requester = ?1 AND rowid NOT IN "
            "(SELECT rowid FROM answered WHERE requester = ?1 ORDER BY rowid DESC LIMIT ?2)");
  Stmt all(db_, "DELETE FROM answered WHERE rowid NOT IN (SELECT rowid FROM answered ORDER BY rowid DESC LIMIT ?1)");
  if (ins.bind(1, r.requester).bind(2, r.txn).bind(3, uint64_t{r.opcode}).bind(4, uint64_t{r.status})
          .bind(5, std::span<const std::byte>(r.payload)).run() &&
      mine.bind(1, r.requester).bind(2, uint64_t{kAnsweredPerRequester}).run() &&
      all.bind(1, uint64_t{kAnsweredKept}).run())
    return true;
  error_ = sqlite3_errmsg(db_);
  return false;
}

Error StateStore::insert_allocation(const AllocationRow& a, const std::vector<ExtentRow>& extents,
                                    uint64_t next_id, const AnsweredRequest* answered) {
  error_.clear();
  if (!begin()) return failed();
  {
    Stmt q(db_,
           "INSERT INTO allocations(id, name, size, stripe, slots, copies, policy, key) VALUES(?, ?, ?, ?, ?, ?, ?, ?)");
    if (!q.bind(1, a.id).bind(2, a.name).bind(3, a.size).bind(4, a.stripe).bind(5, a.slots).bind(6, a.copies)
             .bind(7, a.policy).bind(8, a.key).run())
      return rollback();
  }
  for (const auto& e : extents)
    if (!insert_extent(db_, e)) return rollback();
  if (!set_meta_row("next_id", next_id)) return rollback();
  if (answered && !insert_answered(*answered)) return rollback();
  return commit() ? Error::ok() : rollback();
}

Error StateStore::delete_allocation(uint64_t id, const std::vector<uint32_t>& releasing_slots,
                                    const AnsweredRequest* answered) {
  error_.clear();
  if (!begin()) return failed();
  {
    Stmt q(db_, "DELETE FROM allocations WHERE id = ?");
    if (!q.bind(1, id).run()) return rollback();
  }
  {
    Stmt q(db_, "DELETE FROM opt_configs WHERE alloc_id = ?");
    if (!q.bind(1, id).run()) return rollback();
  }
  for (uint32_t slot : releasing_slots) {
    Stmt q(db_, "UPDATE extents SET state = ? WHERE alloc_id = ? AND slot = ?");
    if (!q.bind(1, static_cast<uint64_t>(ExtentState::kReleasing)).bind(2, id).bind(3, slot).run()) return rollback();
  }
  {
    Stmt q(db_, "DELETE FROM extents WHERE alloc_id = ? AND state != ?");
    if (!q.bind(1, id).bind(2, static_cast<uint64_t>(ExtentState::kReleasing)).run()) return rollback();
  }
  if (answered && !insert_answered(*answered)) return rollback();
  return commit() ? Error::ok() : rollback();
}

Error StateStore::put_opt_config(uint64_t alloc_id, std::span<const std::byte> config,
                                 const AnsweredRequest* answered) {
  error_.clear();
  if (!begin()) return failed();
  {
    Stmt q(db_, "INSERT OR REPLACE INTO opt_configs(alloc_id, config) VALUES(?, ?)");
    if (!q.bind(1, alloc_id).bind(2, config).run()) return rollback();
  }
  if (answered && !insert_answered(*answered)) return rollback();
  return commit() ? Error::ok() : rollback();
}

Error StateStore::set_extent(const ExtentRow& e) {
  Stmt q(db_, "UPDATE extents SET state = ?, boot = ? WHERE alloc_id = ? AND slot = ?");
  if (q.bind(1, static_cast<uint64_t>(e.state)).bind(2, e.boot).bind(3, e.alloc_id).bind(4, e.slot).run())
    return Error::ok();
  return Error::transport(sqlite3_errmsg(db_));
}

Error StateStore::delete_extent(uint64_t alloc_id, uint32_t slot) {
  Stmt q(db_, "DELETE FROM extents WHERE alloc_id = ? AND slot = ?");
  if (q.bind(1, alloc_id).bind(2, slot).run()) return Error::ok();
  return Error::transport(sqlite3_errmsg(db_));
}

}  // namespace netdam::mmu
