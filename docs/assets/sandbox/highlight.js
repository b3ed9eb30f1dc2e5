// Python colours for the sandbox's editors: the code split into [class, text] pieces, with
// the short class names that Pygments gives the static code on the other pages (k for a
// keyword, s2 for a double-quoted string, ...), so that the theme colours both alike.
// A piece with the class "" is left uncoloured. Joined, the pieces are the code exactly.
//
// It reads Python as Pygments' Python lexer does where the two could disagree on colour
// (the names of imported modules, `in` and `not` as operators, docstrings, the fields of
// f-strings); tests/test_sandbox_page.py compares them, character by character.

const KEYWORDS = new Set(
  ("assert async await break continue del elif else except finally for global if lambda " +
    "pass raise nonlocal return try while yield as with def class").split(" "),
);
const CONSTANTS = new Set(["True", "False", "None"]);
const WORD_OPERATORS = new Set(["in", "is", "and", "or", "not"]);
const BUILTINS = new Set(
  ("__import__ abs aiter all any bin bool bytearray breakpoint bytes callable chr " +
    "classmethod compile complex delattr dict dir divmod enumerate eval filter float format " +
    "frozenset getattr globals hasattr hash hex id input int isinstance issubclass iter len " +
    "list locals map max memoryview min next object oct open ord pow print property range " +
    "repr reversed round set setattr slice sorted staticmethod str sum super tuple type " +
    "vars zip").split(" "),
);
const PSEUDO = new Set(["self", "cls", "Ellipsis", "NotImplemented"]);
// The built-in exceptions and warnings, as Python 3.11 to 3.14 name them.
const EXCEPTIONS = new Set(
  ("ArithmeticError AssertionError AttributeError BaseException BlockingIOError " +
    "BrokenPipeError BufferError BytesWarning ChildProcessError ConnectionAbortedError " +
    "ConnectionError ConnectionRefusedError ConnectionResetError DeprecationWarning EOFError " +
    "EncodingWarning EnvironmentError Exception FileExistsError FileNotFoundError " +
    "FloatingPointError FutureWarning GeneratorExit IOError ImportError ImportWarning " +
    "IndentationError IndexError InterruptedError IsADirectoryError KeyError " +
    "KeyboardInterrupt LookupError MemoryError ModuleNotFoundError NameError " +
    "NotADirectoryError NotImplementedError OSError OverflowError PendingDeprecationWarning " +
    "PermissionError ProcessLookupError RecursionError ReferenceError ResourceWarning " +
    "RuntimeError RuntimeWarning StopAsyncIteration StopIteration SyntaxError SyntaxWarning " +
    "SystemError SystemExit TabError TimeoutError TypeError UnboundLocalError " +
    "UnicodeDecodeError UnicodeEncodeError UnicodeError UnicodeTranslateError UnicodeWarning " +
    "UserWarning ValueError Warning ZeroDivisionError").split(" "),
);

// The data model's special methods: `def __init__` leaves its name uncoloured.
const SPECIAL_METHODS = new Set(
  ("abs add aenter aexit aiter and anext await bool bytes call complex contains del delattr " +
    "delete delitem dir divmod enter eq exit float floordiv format ge get getattr " +
    "getattribute getitem gt hash iadd iand ifloordiv ilshift imatmul imod imul index init " +
    "instancecheck int invert ior ipow irshift isub iter itruediv ixor le len length_hint " +
    "lshift lt matmul missing mod mul ne neg new next or pos pow prepare radd rand rdivmod " +
    "repr reversed rfloordiv rlshift rmatmul rmod rmul ror round rpow rrshift rshift rsub " +
    "rtruediv rxor set setattr setitem str sub subclasscheck truediv xor")
    .split(" ")
    .map((name) => `__${name}__`),
);
// After `match` or `case`, what makes it a name: an operator, or another keyword.
const SOFT_KEYWORD_NOT = new RegExp(
  "^[ \\t]*(?:[:,;=^&|@~)\\]}]|(?:" + [...KEYWORDS, "from", "import", "in", "is", "and", "or",
  "not", "elif", "break", "continue"].join("|") + ")\\b)",
);
const NAME = /[\p{L}_][\p{L}\p{N}_]*/uy;
const NUMBER =
  /(?:\d(?:_?\d)*\.(?:\d(?:_?\d)*)?|\d*\.\d(?:_?\d)*)(?:[eE][+-]?\d(?:_?\d)*)?|\d(?:_?\d)*[eE][+-]?\d(?:_?\d)*j?|0[oO](?:_?[0-7])+|0[bB](?:_?[01])+|0[xX](?:_?[\da-fA-F])+|\d(?:_?\d)*/y;
const NUMBER_CLASS = [
  [/^0[xX]/, "mh"],
  [/^0[oO]/, "mo"],
  [/^0[bB]/, "mb"],
  [/[.eEj]/, "mf"],
];
const OPERATOR = /!=|==|<<|>>|:=|[-~+/*%=<>&^|.@]/y;
const PUNCTUATION = /[\][{}:(),;]/y;
const PREFIXES = new Set(["", "r", "u", "f", "t", "b", "rb", "br", "rf", "fr", "rt", "tr"]);
const STRING_START = /([rRbBuUfFtT]{0,2})("""|'''|"|')/y;
const DOCSTRING = /([ \t]*)([rRuUbB]{0,2})("""[\s\S]*?"""|'''[\s\S]*?''')/y;
const ESCAPE = /\\(?:N\{[^}]*\}|u[\da-fA-F]{4}|U[\da-fA-F]{8}|x[\da-fA-F]{2}|[0-7]{1,3}|[\\abfnrtv"'\n])/y;

/** The code as [class, text] pieces, in order. */
export function highlight(code) {
  const out = new Pieces();
  new Scanner(code, out).run(code.length, false);
  return out.pieces;
}

class Pieces {
  constructor() {
    this.pieces = [];
  }
  add(cls, text) {
    if (!text) return;
    const last = this.pieces[this.pieces.length - 1];
    if (last && last[0] === cls) last[1] += text;
    else this.pieces.push([cls, text]);
  }
}

class Scanner {
  constructor(code, out) {
    this.code = code;
    this.out = out;
    this.at = 0;
    this.mode = null; // "import" or "from" while reading the module names of an import
    this.previous = ""; // the last word read, for `yield from`
  }

  match(pattern) {
    pattern.lastIndex = this.at;
    return pattern.exec(this.code);
  }

  take(cls, text) {
    this.out.add(cls, text);
    this.at += text.length;
  }

  /** Read up to `end`; inside an f-string field, stop before its closing `}`, `:` or `!x`. */
  run(end, field) {
    let depth = 0;
    while (this.at < end) {
      const ch = this.code[this.at];
      if (field && depth === 0) {
        const close = this.match(/(=\s*)?(![sraf])?[}:]/y);
        if (close) return;
      }
      if (!field && (this.at === 0 || this.code[this.at - 1] === "\n") && this.docstring()) continue;
      if (ch === "\n" || ch === " " || ch === "\t" || ch === "\r" || ch === "\f") {
        if (ch === "\n" && this.mode) this.mode = null;
        this.take("", ch);
      } else if (ch === "#" && !field) {
        const stop = this.code.indexOf("\n", this.at);
        this.take("c1", this.code.slice(this.at, stop < 0 ? end : stop));
      } else if (ch === "\\") {
        this.take("", ch);
      } else if (this.mode) {
        this.importPart();
      } else if (this.string()) {
        // read
      } else if (this.word()) {
        // read
      } else {
        depth += this.symbol(field);
      }
    }
  }

  /** A triple-quoted string that starts a line: a docstring, coloured as a comment. */
  docstring() {
    const m = this.match(DOCSTRING);
    if (!m) return false;
    this.take("", m[1]);
    this.take("sa", m[2]);
    this.take("sd", m[3]);
    return true;
  }

  /** The names after `import`, or between `from` and `import`: module names. */
  importPart() {
    const ch = this.code[this.at];
    const name = this.match(NAME);
    if (name && name[0] === "as" && this.mode === "import") return this.take("k", "as");
    if (name && name[0] === "import" && this.mode === "from") {
      this.mode = null;
      return this.take("kn", "import");
    }
    if (name && name[0] === "None" && this.mode === "from") {
      this.mode = null; // raise ... from None
      return this.take("kc", "None");
    }
    if (name) return this.take("nn", name[0]);
    if (ch === ".") return this.take("nn", ".");
    if (ch === "," && this.mode === "import") return this.take("o", ",");
    this.mode = null; // anything else ends the import's names
  }

  string() {
    const m = this.match(STRING_START);
    if (!m) return false;
    const prefix = m[1].toLowerCase();
    if (!PREFIXES.has(prefix)) return false;
    const before = this.code[this.at - 1];
    if (before && /[\p{L}\p{N}_]/u.test(before)) return false; // the end of a name
    const quote = m[2];
    const cls = quote[0] === '"' ? "s2" : "s1";
    this.take("sa", m[1]);
    this.take(cls, quote);
    const raw = prefix.includes("r");
    const fstring = /[ft]/.test(prefix);
    this.body(quote, cls, raw, fstring);
    return true;
  }

  /** A string's text up to its closing quote (or the end of the line, for one quote). */
  body(quote, cls, raw, fstring) {
    const triple = quote.length === 3;
    while (this.at < this.code.length) {
      if (this.code.startsWith(quote, this.at)) return this.take(cls, quote);
      const ch = this.code[this.at];
      if (ch === "\n" && !triple) return;
      const escape = this.escape(quote, raw, triple);
      if (escape) {
        this.take("se", escape);
      } else if (fstring && /^(\{\{|\}\})/.test(this.code.slice(this.at, this.at + 2))) {
        this.take("se", this.code.slice(this.at, this.at + 2));
      } else if (fstring && ch === "{") {
        this.field();
      } else if (fstring && ch === "}") {
        this.take("si", ch);
      } else {
        this.take(cls, ch);
      }
    }
  }

  /** The escape sequence at this point of a string, if any: a raw string knows only
   * a backslash before a backslash, its own quote or a line end (and a triple one none). */
  escape(quote, raw, triple) {
    if (this.code[this.at] !== "\\") return null;
    if (!raw) return this.match(ESCAPE)?.[0] ?? null;
    const pair = this.code.slice(this.at, this.at + 2);
    return !triple && ["\\\\", "\\" + quote, "\\\n"].includes(pair) ? pair : null;
  }

  /** An f-string's `{expression!r:spec}`: the expression is code, the rest string. */
  field() {
    this.take("si", "{");
    const mode = this.mode;
    this.mode = null;
    this.run(this.code.length, true);
    this.mode = mode;
    const close = this.match(/(=\s*)?(![sraf])?[}:]/y);
    if (close) this.take("si", close[0]);
  }

  /** A number, or a name: a keyword, a built-in, or another name. */
  word() {
    const m = this.match(NAME);
    const number = m ? null : this.match(NUMBER);
    if (number) {
      const found = NUMBER_CLASS.find(([pattern]) => pattern.test(number[0]));
      this.take(found ? found[1] : "mi", number[0]);
      return true;
    }
    if (!m) return false;
    const word = m[0];
    const previous = this.previous;
    this.previous = word;
    if (word === "def" || word === "class") {
      this.definition(word);
    } else if (word === "import" || (word === "from" && previous !== "yield")) {
      this.mode = word;
      this.take("kn", word);
    } else {
      this.take(this.kind(word), word);
    }
    return true;
  }

  /** The class of a name that is not `def`, `class`, `import` or `from ...`. */
  kind(word) {
    if (KEYWORDS.has(word) || word === "from" || this.softKeyword(word)) return "k";
    if (CONSTANTS.has(word)) return "kc";
    if (WORD_OPERATORS.has(word)) return "ow";
    if (this.code[this.at - 1] === ".") return "n"; // an attribute: never a built-in
    if (BUILTINS.has(word)) return "nb";
    if (PSEUDO.has(word)) return "bp";
    if (EXCEPTIONS.has(word)) return "ne";
    return "n";
  }

  /** `match` and `case` that start a statement: at a line's start, and not a name in use
   * (`match = ...`, `case(...)`). */
  softKeyword(word) {
    if (word !== "match" && word !== "case") return false;
    const line = this.code.lastIndexOf("\n", this.at - 1) + 1;
    if (!/^[ \t]*$/.test(this.code.slice(line, this.at))) return false;
    const rest = this.code.slice(this.at + word.length);
    return !SOFT_KEYWORD_NOT.test(rest);
  }

  /** `def name` and `class Name`: the keyword, then the name it defines. */
  definition(word) {
    this.take("k", word);
    const space = this.match(/\s+/y);
    if (!space) return;
    this.take("", space[0]);
    const name = this.match(NAME);
    const special = SPECIAL_METHODS.has(name?.[0]); // __init__: Pygments' fm, uncoloured
    if (name) this.take(word === "class" ? "nc" : special ? "fm" : "nf", name[0]);
  }

  /** An operator, a bracket or another sign; how much it opens (1) or closes (-1). */
  symbol(field) {
    const ch = this.code[this.at];
    if (ch === "@") {
      const decorator = this.match(/@[\p{L}_][\p{L}\p{N}_]*/uy);
      if (decorator) {
        this.take("nd", decorator[0]);
        return 0;
      }
    }
    const op = this.match(OPERATOR);
    if (op) {
      this.take("o", op[0]);
      return 0;
    }
    if (this.match(PUNCTUATION)) {
      this.take("p", ch);
      if (field) return "([{".includes(ch) ? 1 : ")]}".includes(ch) ? -1 : 0;
      return 0;
    }
    this.take("", ch);
    return 0;
  }
}
